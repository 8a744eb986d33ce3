"""LoRA: low-rank adapters on the attention and MLP projections, base weights frozen, in any layout.

apply_lora(model, cfg, dims, seed) runs after the base weights are in place (seeded, Hugging Face or
checkpoint) and before the optimizer is built. It freezes every parameter (requires_grad False: no
gradient, no optimizer state, nothing in an adapter-only checkpoint) and, for each projection named by
LORA_PLAN and model.lora_targets, adds two parameters to the projection module itself:

    lora_A (r, D_in)  drawn like PEFT's default (uniform, bound 1/sqrt(D_in))
    lora_B (D_out, r) zeros, so the adapted model starts as the base model
    y = base(x) + (alpha / r) * dropout(x) A^T B^T

so the global names are layers.N.attn.wq.lora_A / .lora_B and every base name is unchanged (Hugging
Face load, checkpoints and export keep working). The module's class is swapped in place for a
subclass whose forward adds the adapter (as weight_grads.apply_grad_accumulation_fusion does), so the
pipeline chunks' references, the tensor-parallel hooks and the deferred weight gradients stay.

Tensor parallelism (no communication beyond the base projection's own):
- column-parallel base (wq, wk, wv, gate, up: output rows split): B is split by output rows like the
  base weight, A is replicated. The input x is already inside the tp region (the attn / mlp pre-hook's
  copy_to_tp, or the sequence gather), whose backward all-reduces dx, so the adapter's contribution to
  dx (partial on each rank: only its rows of B) is summed there for free. A's own gradient is partial
  in the same way; it is listed in `tp_partial_grads`, so sync_tp_partial_grads sums it once per
  optimizer step (r x D_in numbers) instead of adding a per-microbatch all-reduce of the (B, T, r)
  adapter activation, which would be the alternative (copy_to_tp on A x).
- row-parallel base (wo, down: input columns split): A is split by input columns like the base weight,
  B is replicated. Each rank's (alpha/r) B A_local x_local is a partial sum, added to the base's
  partial product BEFORE its all-reduce (or reduce-scatter under sequence parallelism), so one
  reduction sums both. B's gradient (dy^T times this rank's partial A x) is tp-partial: listed too.
- replicated kv heads (n_kv_heads < tp): A and B are replicated like wk / wv and each rank uses B's
  rows of its kv head; both gradients are tp-partial.
Shards are declared in `param_shards`, so initialisation is layout-independent (the full tensor drawn
from (seed, global name), then sliced: pipetrain.models.init), and checkpoints, the gradient norm and
ZeRO see the adapters as ordinary sharded or replicated parameters. Pipeline and data parallelism need
nothing: the adapters are parameters of the layers they sit in.

Dropout draws from torch's RNG on each rank, so a run with lora_dropout > 0 is reproducible per layout,
not across layouts (the layout rule is checked with lora_dropout 0).
"""
from __future__ import annotations

import math
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipetrain.config import ConfigError, ModelConfig, lora_projections
from pipetrain.models.init import name_seed
from pipetrain.parallel.mesh.comm import reduce_from_tp, reduce_scatter_sequence
from pipetrain.parallel.tensor.layers import ColumnParallelLinear, ReplicatedKVLinear, RowParallelLinear
from pipetrain.parallel.pipeline.weight_grads import linear

# target name (model.lora_targets) -> module name with any "layers.<i>." prefix removed
LORA_PLAN: dict[str, str] = {"wq": "attn.wq", "wk": "attn.wk", "wv": "attn.wv", "wo": "attn.wo",
                             "gate": "mlp.gate", "up": "mlp.up", "down": "mlp.down"}
ADAPTER_NAMES = ("lora_A", "lora_B")
_LAYER_PREFIX = re.compile(r"^layers\.\d+\.")


def lora_targets(cfg: ModelConfig) -> tuple[str, ...]:
    """The targets of cfg (model.lora_targets, or every projection the family has when empty)."""
    return tuple(cfg.lora_targets) or lora_projections(cfg.family)


def is_adapter(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ADAPTER_NAMES


class LoRAAdapted:
    """Mixin of an adapted projection: forward adds (alpha / r) B A dropout(x) to the base output."""

    lora_scale: float
    lora_dropout: float
    lora_rows: tuple[int, int] | None = None  # replicated kv: the rows of B this rank's kv head uses

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_dropout and self.training:
            x = F.dropout(x, self.lora_dropout)
        b = self.lora_B if self.lora_rows is None else self.lora_B[self.lora_rows[0]:self.lora_rows[1]]
        return F.linear(F.linear(x, self.lora_A), b) * self.lora_scale  # (B, T, r) inside

    def forward(self, x):
        return super().forward(x) + self.lora_delta(x)


class LoRARowAdapted(LoRAAdapted):
    """RowParallelLinear's forward with the adapter's partial sum added before the tp reduction."""

    def forward(self, x):  # x (B, T, D_in/tp)
        y = linear(x, self.weight, None, self.fuse, self.deferred) + self.lora_delta(x)  # this rank's partial sum
        if self.sequence_parallel:
            y = reduce_scatter_sequence(y, self.tp_group)  # (B, T/tp, D_out)
        else:
            y = reduce_from_tp(y, self.tp_group)  # (B, T, D_out)
        return y if self.bias is None else y + self.bias


_CLASSES: dict[type, type] = {}


def _adapted_class(cls: type) -> type:
    if cls not in _CLASSES:
        mixin = LoRARowAdapted if issubclass(cls, RowParallelLinear) else LoRAAdapted
        _CLASSES[cls] = type(f"LoRA{cls.__name__}", (mixin, cls), {"lora_base_class": cls})
    return _CLASSES[cls]


def adapter_init(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The full fp32 adapter tensor of a global name: lora_A uniform(+-1/sqrt(D_in)), lora_B zeros."""
    if name.endswith("lora_B"):
        return torch.zeros(shape)
    bound = 1.0 / math.sqrt(shape[1])
    gen = torch.Generator().manual_seed(name_seed(seed, name))
    return torch.empty(shape).uniform_(-bound, bound, generator=gen)


@torch.no_grad()
def apply_lora(model: nn.Module, cfg: ModelConfig, dims, seed: int) -> list[str]:
    """Freeze model and add adapters to its targeted projections (module docstring), in place, with
    weights of the base's device and dtype. Returns the adapted module names. A no-op when
    cfg.lora_rank is None."""
    if cfg.lora_rank is None:
        return []
    if any(isinstance(m, LoRAAdapted) for m in model.modules()):
        raise ValueError("apply_lora: the model already has adapters; apply it once")
    known = lora_projections(cfg.family)
    bad = [t for t in lora_targets(cfg) if t not in known]
    if bad:
        raise ConfigError(f"model.lora_targets: {cfg.family} has no projection {bad[0]!r}, got "
                          f"{list(cfg.lora_targets)}; use names from {list(known)}")
    wanted = {LORA_PLAN[t] for t in lora_targets(cfg)}
    for p in model.parameters():
        p.requires_grad_(False)
    r, tp, tp_rank = cfg.lora_rank, getattr(dims, "tp", 1), getattr(dims, "tp_rank", 0)
    adapted = []
    for name, module in list(model.named_modules()):
        if _LAYER_PREFIX.sub("", name) not in wanted:
            continue
        w = module.weight
        d_out, d_in = module.out_features, module.in_features
        shards = dict(getattr(module, "param_shards", {}))
        partial = tuple(getattr(module, "tp_partial_grads", ()))
        a_shape, b_shape = [r, d_in], [d_out, r]
        if isinstance(module, RowParallelLinear):
            a_shape[1] //= tp
            shards["lora_A"] = (1, tp_rank, tp)
            partial += ("lora_B",)
        elif isinstance(module, ColumnParallelLinear):
            b_shape[0] //= tp
            shards["lora_B"] = (0, tp_rank, tp)
            partial += ("lora_A",)
        elif isinstance(module, ReplicatedKVLinear):
            module.lora_rows = module.rows
            partial += ("lora_A", "lora_B")
        for pname, shape in (("lora_A", a_shape), ("lora_B", b_shape)):
            full_shape = [n * shards[pname][2] if pname in shards and i == shards[pname][0] else n
                          for i, n in enumerate(shape)]
            full = adapter_init(f"{name}.{pname}", tuple(full_shape), seed)
            if pname in shards:
                dim, index, count = shards[pname]
                full = full.chunk(count, dim)[index]
            setattr(module, pname, nn.Parameter(full.to(device=w.device, dtype=w.dtype).contiguous()))
        if shards:
            module.param_shards = shards
        if partial and tp > 1:
            module.tp_partial_grads = partial
        module.lora_scale = cfg.lora_alpha / r
        module.lora_dropout = cfg.lora_dropout
        module.__class__ = _adapted_class(type(module))
        adapted.append(name)
    return adapted


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (W += (alpha / r) B A) and restore the plain classes,
    in place; for a whole single-process model (the merged export). Returns model."""
    for module in model.modules():
        if not isinstance(module, LoRAAdapted):
            continue
        module.weight.add_((module.lora_B.float() @ module.lora_A.float() * module.lora_scale).to(module.weight.dtype))
        del module.lora_A, module.lora_B
        module.__class__ = module.lora_base_class
        shards = getattr(module, "param_shards", None)
        if shards:
            shards.pop("lora_A", None)
            shards.pop("lora_B", None)
    return model


def count_trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
