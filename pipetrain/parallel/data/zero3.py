"""ZeRO stage 3: parameters sharded across dp too, gathered one unit (a block, the embedding, the head) at a time.

What a rank holds. Every parameter of this (tp, pp) rank keeps only its dp row shard (ZeRO-1/2's
ParamShard rows, dp_row_ranges), in its own storage: that shard is the fp32 master the AdamW step
updates. The parameter tensor the model sees keeps its full shape, but its storage is resized to zero
bytes except while its unit is gathered. Gradients are reduce-scattered into the rank's rows
(ZeroOptimizer's stage-2 buckets) and the AdamW moments cover only those rows, so parameters, gradients
and optimizer state all cost 1/dp per rank.

Units (which modules are gathered together, the hooks that gather and free them, the prefetch, the
freeing): pipetrain/parallel/data/units.py.

Dtypes (FSDP's mixed precision with param_dtype=bf16, reduce_dtype=fp32). The rows, the gradient rows and the
AdamW moments are fp32. Under train.precision=bf16 the linear weights (compute_in_bf16: the weight of every
linear that is its only user, outside the tp / pp gradient syncs) are bf16 tensors in the model: their rows
are rounded to bf16 before the all-gather (half the bytes), and autocast, finding them already bf16, saves
them and not a copy for backward, so freeing a unit frees the weights its backward will read (an fp32
weight's bf16 copy would stay saved until then). Autocast would round them so at every matmul: the values
computed with are those of zero 1's bf16 run. Their gradients arrive in bf16, one per microbatch and use,
and are summed in fp32 beside the parameter (_main_grads), as zero 1's fp32 .grad sums them, then
reduce-scattered in fp32. Norms, biases, embeddings (and a tied head) are gathered and kept in fp32, as
autocast leaves them. fp32 runs gather everything in fp32.

fp8 (train.precision=fp8, torchtitan's float8 all-gather for FSDP2). The fp8 linears (parallel/tensor/fp8.py)
quantise their weight with the whole weight's scale anyway, so zero 3 quantises before gathering: each fp8
weight's rows (fp32 masters) are rounded to float8_e4m3fn with that scale and gathered at one byte an element
into an Fp8Weight that the module's Fp8Linear reads (spec.gathered) instead of quantising the weight. The
scales come from the rows: every weight's amax over its rows, all-reduced (max) over dp and tp in one
collective per group, once per step (fp8_scales, before the first gather after a step, a zero_grad or a
load), which is the amax the fp8 linear of zero 0-2 takes over the whole weight (and over tp): the
quantised weights, and so the losses, are zero 1's bit for bit. The linear's fp32 parameter stays in the
model, holds no values, and receives its fp32 gradient as any other. The fp8 weight autograd saves for
backward is the gathered one (freed with its unit, gathered again for backward) instead of a quantised copy.
The other linears (an untied head) are bf16 as under train.precision=bf16, since fp8 runs them under bf16
autocast. Rowwise recipes (train.fp8_recipe: rowwise, rowwise_with_gw_hp; fp8_rowwise.py) quantise each weight
along its rows, with a scale per output (and input) channel, which no one-scale float8 gather holds: their
weights are gathered in fp32, as zero 1 hands them to the linear, which quantises them itself (torchtitan
gathers rowwise weights in high precision too, though in bf16: a bf16 rounding before the float8 one would
change a value where the bf16 rounding lands on a tie of float8, and the losses would no longer be zero 1's).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn as nn

from pipetrain.config import TrainConfig
from pipetrain.models.init import param_layout
from pipetrain.optim.adamw import ReadBox
from pipetrain.parallel.data.allreduce import DEFAULT_BUCKET_BYTES
from pipetrain.parallel.data.grads import model_parallel_synced_params, tied_copy_names
from pipetrain.parallel.data.units import UnitGatherer
from pipetrain.parallel.data.zero import ZeroOptimizer
from pipetrain.parallel.tensor.fp8 import FORWARD_DTYPE, Fp8Weight, weight_scales
from pipetrain.parallel.tensor.layers import ColumnParallelLinear, ReplicatedKVLinear, RowParallelLinear

LINEARS = (nn.Linear, ColumnParallelLinear, RowParallelLinear, ReplicatedKVLinear)  # autocast runs their matmuls


def compute_in_bf16(model: nn.Module, dims) -> set[int]:
    """ids of the parameters ZeRO-3 gathers and keeps in bf16 under train.precision=bf16: the weight of a linear
    that no other module uses (not a tied embedding) and whose gradient no tp / pp sync reads (the tied head copy,
    a kv weight replicated over tp). A head train.fused_loss reads is one too: the fused loss runs under the
    chunks' autocast, which would cast an fp32 weight to these same bf16 values."""
    users: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            users.setdefault(id(p), []).append((module, name))
    synced = {id(p) for p in model_parallel_synced_params(model, dims)}
    return {pid for pid, uses in users.items()
            if pid not in synced and all(name == "weight" and isinstance(m, LINEARS) for m, name in uses)}


def unit_gatherer(optimizer) -> Optional[UnitGatherer]:
    """The UnitGatherer of a ZeRO-3 optimizer, also inside a wrapper across replicas (HSDP); under expert
    parallelism the non-expert part's, which holds the head (train.fused_loss gathers it); None otherwise."""
    while optimizer is not None:
        if isinstance(optimizer, Zero3Optimizer):
            return optimizer.gatherer
        optimizer = getattr(optimizer, "dense", None) or getattr(optimizer, "wrapped", None)
    return None


class Zero3Optimizer(ZeroOptimizer):
    """ZeRO-3: ZeroOptimizer's stage-2 gradient reduction and sharded AdamW, with the parameters themselves
    sharded (the rows are the masters) and gathered per unit by hooks (UnitGatherer, built here).
    Same interface as ZeroOptimizer, plus param_items / load_param_items for checkpoints. owns, shard_over and
    sync_model_parallel are ZeroOptimizer's: expert parallelism builds two (parallel/expert/zero.py), the experts'
    sharded and gathered over expert-dp, each gathering its own parameters of a unit."""

    def __init__(self, model: nn.Module, dims, cfg: TrainConfig, reshard_after_forward: bool = True,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = True, owns=None, shard_over=None,
                 sync_model_parallel: bool = True):
        super().__init__(model, dims, cfg, stage=3, bucket_bytes=bucket_bytes, overlap=overlap, owns=owns,
                         shard_over=shard_over, sync_model_parallel=sync_model_parallel)
        for view in self.views.values():  # the rows become the masters, in storage of their own
            view.data = view.data.clone()
        # Frozen parameters (LoRA's base) are sharded and gathered too, but carry no gradient and no AdamW
        # state: they follow the trainable ones in self.params / self.shards (no bucket, no hook), their
        # rows live in self.rows only.
        self.num_trainable = len(self.params)
        self.rows: dict[int, torch.Tensor] = dict(self.views)
        layout = param_layout(model)
        for name, p in model.named_parameters():
            if not p.requires_grad and (owns is None or owns(p)):
                i = len(self.params)
                self.params.append(p)
                self.shards.append(self._param_shard(name, p, layout))
                if self.shards[i].numel(self.dp_rank):
                    self.rows[i] = self._rows(p.detach(), i).clone()
        self.reduce_scatters = 0
        # bf16 compute weights (module docstring): the parameter becomes bf16, its rows stay the fp32 master
        self._master_dtype = [p.dtype for p in self.params]
        self._main_grads: dict[int, torch.Tensor] = {}  # fp32 sums of a bf16 weight's gradients this step
        # fp8 linears' weights (module docstring, "fp8"): gathered quantised into an Fp8Weight of their module
        self.fp8_weights: dict[int, Fp8Weight] = {}
        self.fp8_tp_group = None
        index = {id(p): i for i, p in enumerate(self.params)}
        rowwise = set()  # ids of the weights of rowwise fp8 linears: gathered and given to them in fp32
        for module in model.modules():
            spec = getattr(module, "fp8", None)
            if spec is not None and spec.rowwise:
                rowwise.add(id(module.weight))
            elif spec is not None and index.get(id(module.weight)) is not None:
                holder = Fp8Weight(module.weight.shape, module.weight.device)
                module.fp8 = dataclasses.replace(spec, gathered=holder)
                self.fp8_weights[index[id(module.weight)]] = holder
                self.fp8_tp_group = spec.tp_group
        if cfg.precision in ("bf16", "fp8"):  # fp8: the other linears (the head) run under bf16 autocast
            low = compute_in_bf16(model, dims) - rowwise
            for i, p in enumerate(self.params):
                if id(p) in low and i not in self.fp8_weights:
                    p.data = p.data.to(torch.bfloat16)
        self.gatherer = UnitGatherer(self, model, reshard_after_forward)
        self.gatherer.free_all()

    # the masters are the rows (views own their storage): nothing to re-point, nothing to gather after a step
    def _bind_views(self) -> None:
        pass

    def _all_gather_params(self) -> None:
        pass

    def _make_hook(self, i: int):
        count = super()._make_hook(i)

        def hook(p: torch.Tensor) -> None:
            if p.grad is not None and p.grad.dtype != self._master_dtype[i]:  # a bf16 weight: summed in fp32
                total = self._main_grads.get(i)
                if total is None:
                    self._main_grads[i] = p.grad.to(self._master_dtype[i])
                else:
                    total.add_(p.grad)
                p.grad = None
            count(p)
        return hook

    def gather_dtype(self, i: int) -> torch.dtype:
        """The dtype parameter i is gathered and computed in: its own, or float8 for an fp8 linear's weight."""
        return FORWARD_DTYPE if i in self.fp8_weights else self.params[i].dtype

    def fp8_scales(self) -> None:
        """Set every fp8 weight's scale from its rows on all dp (and tp) ranks: the whole weight's amax, as the
        fp8 linear of zero 0-2 takes it from the weight it is given (one all-reduce per group for them all)."""
        ids = sorted(self.fp8_weights)
        groups = [self.dp_group] + ([self.fp8_tp_group] if self.fp8_tp_group is not None else [])
        scales = weight_scales([self.rows.get(i) for i in ids], groups, self.params[ids[0]].device)  # (n,)
        for i, scale in zip(ids, scales):
            self.fp8_weights[i].scale.data.copy_(scale)

    def _grad(self, i: int) -> Optional[torch.Tensor]:
        return self._main_grads[i] if i in self._main_grads else self.params[i].grad

    def _grad_dtype(self, i: int) -> torch.dtype:
        return self._master_dtype[i]

    def _drop_grad(self, i: int) -> None:
        self._main_grads.pop(i, None)
        self.params[i].grad = None

    def grad_bytes(self) -> int:
        return super().grad_bytes() + sum(g.numel() * g.element_size() for g in self._main_grads.values())

    def _launch(self, bucket) -> None:
        self.reduce_scatters += 1  # tests count them against the buckets: each gradient row reduced once a step
        super()._launch(bucket)

    def step(self, lr: float) -> None:
        super().step(lr)
        self.gatherer.scales_stale = True  # the masters moved: fp8 weights need new scales (evaluation next)

    def zero_grad(self) -> None:
        self.gatherer.free_all()  # units a failed step left gathered
        self.gatherer.scales_stale = True  # (rows a rerun or a load may have replaced since the last step)
        self._main_grads = {}
        super().zero_grad()

    def reduce_grads(self) -> None:
        self.gatherer.free_all()  # backward is over: nothing needs the gathered weights
        super().reduce_grads()

    def param_bytes(self) -> int:
        """Bytes of parameters this rank holds now: its rows plus whatever unit storage is gathered."""
        rows = sum(v.numel() * v.element_size() for v in self.rows.values())
        full = sum(self.gatherer.target(i).untyped_storage().nbytes() for i in range(len(self.params)))
        return rows + full

    # ---- checkpoints: the model's weights are row boxes from every dp rank, like the moments ----
    def param_items(self, trainable_only: bool = False) -> list[tuple[str, torch.Tensor, tuple[int, ...],
                                                                       tuple[int, ...]]]:
        """(name, rows, global shape, offsets) of this rank's row shard of every parameter (trainable_only:
        LoRA's adapters, not the frozen base); the tied head copy on the last stage is left out (the first
        stage's embed.weight holds the same values)."""
        skip = tied_copy_names(self.model)
        out = []
        for i, rows in self.rows.items():
            shard = self.shards[i]
            if shard.name not in skip and not (trainable_only and i >= self.num_trainable):
                out.append((shard.name, rows, shard.global_shape, shard.box(self.dp_rank)[0]))
        return out

    def load_param_items(self, read: ReadBox, trainable_only: bool = False) -> None:
        """Read this rank's rows of every parameter (trainable_only: an adapter checkpoint, whose frozen base
        came from init_from or the seed); the tied head copy reads embed.weight's."""
        tied = tied_copy_names(self.model)
        with torch.no_grad():
            for i, rows in self.rows.items():
                if trainable_only and i >= self.num_trainable:
                    continue
                shard = self.shards[i]
                offsets, shape = shard.box(self.dp_rank)
                saved = "embed.weight" if shard.name in tied else shard.name
                rows.copy_(read(saved, shard.global_shape, offsets, shape))
        self.gatherer.scales_stale = True
