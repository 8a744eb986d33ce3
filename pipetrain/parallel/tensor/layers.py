"""Megatron-style tensor parallelism (optionally with sequence parallelism), applied from outside.

apply_tensor_parallel(model, dims) walks the plain Decoder and, from the name table TP_PLAN, swaps
nn.Linear / nn.Embedding for sharded versions that keep the attribute names `weight` and `bias`, so
every global parameter name (layers.0.attn.wq.weight) survives. Sharded modules declare
`param_shards = {"weight": (dim, index, count)}`; pipetrain.models.init.materialize and the checkpoint
code read it. Build on meta, apply TP, then materialize: every shard is cut from the full tensor.

The sharded linears and the vocab embedding are WeightGradModules (pipetrain.parallel.pipeline.weight_grads):
apply_grad_accumulation_fusion, called after this, sets their fusion; the executor defers their
weight gradients under the split backward.

Attention and MLP blocks are entered once (a forward pre-hook on `attn` / `mlp`): the block input is
copied into the tp region (f: backward all-reduce) or, with sequence parallelism, all-gathered along
T (backward reduce-scatter); wq/wk/wv (or gate/up) then share that one collective. Row-parallel
wo / down leave the region with an all-reduce (g), or a reduce-scatter along T under sequence
parallelism. The LM head enters the region itself and its logits stay vocab-sharded (B, T, V/tp) for
the vocab-parallel loss, pipetrain.parallel.tensor.cross_entropy.vocab_parallel_cross_entropy(..., dims.tp_group).

Rules (docs/tensor_parallel.md explains them):
- heads: tp divides n_heads; kv heads are split when tp divides n_kv_heads, replicated (each rank
  computes only its one kv head from the full wk/wv) when n_kv_heads divides tp; anything else is an error.
- vocab: tp must divide vocab_size (no padding: padded rows would change global shapes, checkpoints
  and Hugging Face export); ffn_hidden must be divisible by tp too.
- tp-partial gradients: a parameter replicated over tp whose gradient each rank computes only in part
  (replicated kv weights; under sequence parallelism norm weights/biases, the gpt2 position embedding,
  row-parallel biases) is listed in its module's `tp_partial_grads`; call sync_tp_partial_grads(model,
  dims) after backward (before the dp all-reduce and clipping).

Shapes: B batch, T time, D model, Hq / Hkv query / key-value heads, K head dim, F ffn, V vocab; a
sharded size is written X/tp, a sequence-parallel activation (B, T/tp, D).
"""
from __future__ import annotations

import re

import torch
import torch.nn as nn

from pipetrain.config import ModelConfig
from pipetrain.models.moe import Experts, MoE
from pipetrain.parallel.mesh.comm import (copy_to_tp, gather_sequence, gather_sequence_replicated, reduce_from_tp,
                                          reduce_scatter_sequence)
from pipetrain.parallel.data.allreduce import allreduce_grads
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.mesh.rules import tensor_parallel_problems
from pipetrain.parallel.pipeline.weight_grads import WeightGradModule, embedding, linear

# Module name (with any "layers.<i>." prefix removed) -> how it is parallelised.
TP_PLAN: dict[str, str] = {
    "embed": "vocab",         # rows split by vocab; output all-reduced (reduce-scattered along T under sp)
    "pos_embed": "position",  # sp only: returns this rank's (T/tp, D) rows
    "attn": "region",         # input enters the tp region once for wq, wk, wv
    "attn.wq": "column",      # (B, T, Hq/tp * K)
    "attn.wk": "kv",          # column when tp | Hkv, else the replicated kv head
    "attn.wv": "kv",
    "attn.wo": "row",         # (B, T, D), reduced over tp
    "mlp": "region",
    "mlp.gate": "column",     # (B, T, F/tp)
    "mlp.up": "column",
    "mlp.down": "row",
    "attn.q_norm": "qk_norm",  # qwen3_moe: one (K,) weight over this rank's heads only, gradient tp-partial
    "attn.k_norm": "qk_norm",
    # a mixture of experts ("mlp" is then a models.moe.MoE): the router stays replicated outside the region
    # (every tp rank routes the same whole sequence); each expert is F-sharded like the MLP, and the experts'
    # summed output leaves the region with the MLP's one all-reduce (reduce-scatter along T under sp)
    "mlp.router": "router",   # sp only: (B, T/tp, D) -> logits all-gathered to (B, T, E), gradient tp-partial
    "mlp.experts": "experts",
    "mlp.shared": "region",
    "mlp.shared.gate": "column",
    "mlp.shared.up": "column",
    "mlp.shared.down": "row",
    "attn_norm": "norm",      # sp only: runs on (B, T/tp, D), gradient tp-partial
    "mlp_norm": "norm",
    "norm": "norm",
    "head": "head",           # column-parallel entering the region itself; logits (B, T, V/tp)
}
_LAYER_PREFIX = re.compile(r"^layers\.\d+\.")


def _new_param(shape, like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=like.device, dtype=like.dtype), requires_grad=like.requires_grad)


def _enter_tp(module: nn.Module, dims: ParallelDims, split: tuple[str, int], sequence_parallel: bool,
              like: torch.Tensor | None) -> torch.Tensor:
    """What every tp-sharded module's __init__ does first: check that the dim it splits over tp, (name, size),
    divides, and keep its tp group and sequence-parallel flag. Returns the tensor its parameters are made like
    (device, dtype, requires_grad; an empty CPU tensor when like is None)."""
    name, size = split
    assert size % dims.tp == 0, f"{name}={size} is not divisible by tp={dims.tp}"
    module.tp_group, module.sequence_parallel = dims.tp_group, sequence_parallel
    return torch.empty(0) if like is None else like


class _FromLinear:
    """from_linear for the sharded linears: the same module built from a plain nn.Linear, its shard cut
    from the linear's weights when they are materialised (kwargs: the class's own options)."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, dims: ParallelDims, **kwargs):
        out = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, dims=dims,
                  like=linear.weight, **kwargs)
        _copy_shards(out, linear)
        return out


@torch.no_grad()
def _copy_shards(module: nn.Module, source: nn.Module) -> None:
    """When swapping a materialised module, cut each local shard from the full source tensor."""
    for name, p in module.named_parameters(recurse=False):
        full = getattr(source, name)
        if full.is_meta:
            continue
        if name in getattr(module, "param_shards", {}):
            dim, index, count = module.param_shards[name]
            full = full.chunk(count, dim)[index]
        p.copy_(full)


class ColumnParallelLinear(_FromLinear, WeightGradModule, nn.Module):
    """y = x W^T + b with W's output rows split over tp: (B, T, D_in) -> (B, T, D_out/tp).

    enter_region=True applies f to the input (copy_to_tp, or gather_sequence under sequence
    parallelism); False when the caller already did (the attn / mlp pre-hook shared by siblings)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dims: ParallelDims,
                 sequence_parallel: bool = False, enter_region: bool = True, like: torch.Tensor | None = None):
        super().__init__()
        like = _enter_tp(self, dims, ("out_features", out_features), sequence_parallel, like)
        tp_size, tp_rank = dims.tp, dims.tp_rank
        self.in_features, self.out_features, self.enter_region = in_features, out_features, enter_region
        self.weight = _new_param((out_features // tp_size, in_features), like)  # (D_out/tp, D_in)
        self.bias = _new_param((out_features // tp_size,), like) if bias else None
        self.param_shards = {"weight": (0, tp_rank, tp_size)}
        if bias:
            self.param_shards["bias"] = (0, tp_rank, tp_size)

    def enter(self, x):
        """x as this layer's matmul takes it: through f when enter_region (the fused loss calls it too)."""
        if self.enter_region:
            x = gather_sequence(x, self.tp_group) if self.sequence_parallel else copy_to_tp(x, self.tp_group)
        return x

    def forward(self, x):
        return linear(self.enter(x), self.weight, self.bias, self.fuse, self.deferred, self.fp8,
                      self.work_key)  # (B, T, D_out/tp)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}/tp, sp={self.sequence_parallel}"


class RowParallelLinear(_FromLinear, WeightGradModule, nn.Module):
    """y = x W^T + b with W's input columns split over tp: (B, T, D_in/tp) -> (B, T, D_out), the partial
    products summed over tp (reduce-scattered to (B, T/tp, D_out) under sequence parallelism). The bias
    is replicated and added after the reduction; under sequence parallelism its gradient is tp-partial."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dims: ParallelDims,
                 sequence_parallel: bool = False, like: torch.Tensor | None = None):
        super().__init__()
        like = _enter_tp(self, dims, ("in_features", in_features), sequence_parallel, like)
        tp_size, tp_rank = dims.tp, dims.tp_rank
        self.in_features, self.out_features = in_features, out_features
        self.weight = _new_param((out_features, in_features // tp_size), like)  # (D_out, D_in/tp)
        self.bias = _new_param((out_features,), like) if bias else None  # (D_out,) replicated
        self.param_shards = {"weight": (1, tp_rank, tp_size)}
        self.tp_partial_grads = ("bias",) if bias and sequence_parallel else ()

    def forward(self, x):  # x (B, T, D_in/tp)
        # (B, T, D_out): this rank's partial sum
        y = linear(x, self.weight, None, self.fuse, self.deferred, self.fp8, self.work_key)
        if self.sequence_parallel:
            y = reduce_scatter_sequence(y, self.tp_group)  # (B, T/tp, D_out)
        else:
            y = reduce_from_tp(y, self.tp_group)  # (B, T, D_out)
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return f"in_features={self.in_features}/tp, out_features={self.out_features}, sp={self.sequence_parallel}"


class ReplicatedKVLinear(_FromLinear, WeightGradModule, nn.Module):
    """wk / wv when n_kv_heads divides tp (fewer kv heads than tp ranks): the full (Hkv*K, D) weight is
    replicated, and each rank computes only the kv head its query heads use, kv_head = tp_rank //
    (tp / Hkv): (B, T, D) -> (B, T, K). Each rank's gradient covers only its head's rows and only its
    query heads' share of them, so weight and bias are tp-partial (see sync_tp_partial_grads)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dims: ParallelDims, head_dim: int,
                 like: torch.Tensor | None = None):
        super().__init__()
        n_kv_heads = out_features // head_dim
        assert dims.tp % n_kv_heads == 0, f"tp={dims.tp} is not a multiple of n_kv_heads={n_kv_heads}"
        like = torch.empty(0) if like is None else like
        self.in_features, self.out_features = in_features, out_features
        kv_head = dims.tp_rank // (dims.tp // n_kv_heads)
        self.rows = (kv_head * head_dim, (kv_head + 1) * head_dim)
        self.weight = _new_param((out_features, in_features), like)  # (Hkv*K, D) replicated
        self.bias = _new_param((out_features,), like) if bias else None
        self.tp_partial_grads = ("weight", "bias") if bias else ("weight",)

    def forward(self, x):  # x (B, T, D), already in the tp region
        lo, hi = self.rows
        bias = None if self.bias is None else self.bias[lo:hi]
        return linear(x, self.weight[lo:hi], bias, self.fuse, self.deferred, self.fp8, self.work_key)  # (B, T, K)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, rows={self.rows}"


class VocabParallelEmbedding(WeightGradModule, nn.Module):
    """Token embedding with vocab rows split over tp: ids (B, T) -> (B, T, D), or (B, T/tp, D) under
    sequence parallelism. Each rank looks up the ids in its row range [tp_rank*V/tp, (tp_rank+1)*V/tp),
    zeroes the others, and the partial sums are all-reduced (reduce-scattered along T)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, dims: ParallelDims,
                 sequence_parallel: bool = False, like: torch.Tensor | None = None):
        super().__init__()
        like = _enter_tp(self, dims, ("num_embeddings", num_embeddings), sequence_parallel, like)
        tp_size, tp_rank = dims.tp, dims.tp_rank
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start = tp_rank * (num_embeddings // tp_size)
        self.weight = _new_param((num_embeddings // tp_size, embedding_dim), like)  # (V/tp, D)
        self.param_shards = {"weight": (0, tp_rank, tp_size)}

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, dims: ParallelDims, **kwargs) -> "VocabParallelEmbedding":
        out = cls(embedding.num_embeddings, embedding.embedding_dim, dims=dims, like=embedding.weight, **kwargs)
        _copy_shards(out, embedding)
        return out

    def forward(self, ids):  # ids (B, T)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = embedding(local.masked_fill(outside, 0), self.weight, self.fuse)  # (B, T, D): this rank's rows only
        h = h.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_sequence(h, self.tp_group)  # (B, T/tp, D)
        return reduce_from_tp(h, self.tp_group)  # (B, T, D)

    def extra_repr(self):
        return f"{self.num_embeddings}/tp, {self.embedding_dim}, sp={self.sequence_parallel}"


class SequenceParallelPositionEmbedding(nn.Embedding):
    """gpt2's learned positions under sequence parallelism: forward(T) returns this rank's (T/tp, D)
    rows. The table is replicated and each rank's gradient covers only its rows: tp-partial."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, dims: ParallelDims, **kwargs):
        super().__init__(num_embeddings, embedding_dim, **kwargs)
        self.tp_rank, self.tp_size = dims.tp_rank, dims.tp
        self.tp_partial_grads = ("weight",)

    def forward(self, seq_len: int, positions: torch.Tensor | None = None):
        if seq_len % self.tp_size:
            raise ValueError(f"sequence parallelism: sequence length {seq_len} is not divisible by "
                             f"tp={self.tp_size}; use a multiple of {self.tp_size}")
        chunk = seq_len // self.tp_size
        if positions is not None:  # document positions (B, T): this rank's (B, T/tp, D) rows
            return self.weight[positions[:, self.tp_rank * chunk:(self.tp_rank + 1) * chunk].to(self.weight.device)]
        return self.weight[self.tp_rank * chunk:(self.tp_rank + 1) * chunk]  # (T/tp, D)


class _EnterRegion:
    """Forward pre-hook on attn / mlp: f applied once to the block input for all its column layers
    (copy_to_tp, or gather_sequence (B, T/tp, D) -> (B, T, D) under sequence parallelism)."""

    def __init__(self, dims: ParallelDims, sequence_parallel: bool):
        self.tp_group, self.sequence_parallel = dims.tp_group, sequence_parallel

    def __call__(self, module, args):
        x, *rest = args  # rest: attention's document positions (B, T), already whole on every rank
        return (gather_sequence(x, self.tp_group) if self.sequence_parallel else copy_to_tp(x, self.tp_group), *rest)


class ExpertRegion:
    """A MoE's tp region around its F-sharded experts (MoE.expert_region). enter: the tokens and their
    routing weights through f (forward identity, backward all-reduce: each rank's expert shards give a
    partial gradient of both); leave: g, the experts' partial outputs summed over tp. The router runs
    outside, on the replicated input, so its gradient is whole on every rank.

    Under sequence parallelism the MoE's input is this rank's (B, T/tp, D): enter all-gathers it along T
    (backward reduce-scatter, as the dense MLP's region) and leave reduce-scatters the summed output back
    to (B, T/tp, D). The router sees the whole sequence through its gathered logits (_gather_router_logits),
    so every tp rank makes tp=1's routing decisions, per-sequence aux loss and counts."""

    def __init__(self, dims: ParallelDims, sequence_parallel: bool = False):
        self.tp_group, self.sequence_parallel = dims.tp_group, sequence_parallel

    def enter(self, x, topk_w):
        x = gather_sequence(x, self.tp_group) if self.sequence_parallel else copy_to_tp(x, self.tp_group)
        return x, copy_to_tp(topk_w, self.tp_group)

    def leave(self, y):
        return reduce_scatter_sequence(y, self.tp_group) if self.sequence_parallel else \
            reduce_from_tp(y, self.tp_group)


class _GatherRouterLogits:
    """Forward hook on a MoE router under sequence parallelism: its logits of this rank's (B, T/tp, D)
    tokens all-gathered to the whole sequence's (B, T, E). Everything after them (softmax, top-k, the aux
    loss, and through f the routing weights) is replicated over tp, so their gradient is already whole on
    every rank: the gather's backward keeps this rank's slice without summing. The router weight's
    gradient then covers only this rank's tokens: tp-partial, summed like a sequence-parallel norm's."""

    def __init__(self, dims: ParallelDims):
        self.tp_group = dims.tp_group

    def __call__(self, module, args, logits):
        return gather_sequence_replicated(logits, self.tp_group)


@torch.no_grad()
def _shard_experts(module: Experts, dims: ParallelDims) -> Experts:
    """Experts with F split over tp: gate/up (E, F/tp, D) (column), down (E, D, F/tp) (row)."""
    E, F_full, D = module.gate.shape
    assert F_full % dims.tp == 0, f"expert ffn={F_full} is not divisible by tp={dims.tp}"
    with torch.device(module.gate.device):
        new = Experts(E, D, F_full // dims.tp).to(module.gate.dtype)
    new.param_shards = {"gate": (1, dims.tp_rank, dims.tp), "up": (1, dims.tp_rank, dims.tp),
                        "down": (2, dims.tp_rank, dims.tp)}
    _copy_shards(new, module)
    return new


def apply_tensor_parallel(model: nn.Module, dims: ParallelDims, sequence_parallel: bool = False) -> None:
    """Shard model (a Decoder, possibly pruned to a pipeline stage) over dims.tp_group, in place.

    A no-op when dims.tp == 1. The model must split tp ways (layout_problems checks the recipe)."""
    if dims.tp == 1:
        return
    cfg: ModelConfig = model.cfg
    problems = tensor_parallel_problems(cfg, dims.tp)
    assert not problems, f"{dims.coords} apply_tensor_parallel: layout_problems rejects tp={dims.tp}: " \
        f"{'; '.join(problems)}"
    if dims.tp_group is None:
        raise ValueError(f"{dims.coords} apply_tensor_parallel: tp={dims.tp} but dims has no tp_group; build "
                         "dims with ParallelDims.init / from_degrees after init_process_group")
    if any(hasattr(m, "param_shards") for m in model.modules()):
        raise ValueError("apply_tensor_parallel: the model is already tensor-parallel; apply it once")
    embed, head = getattr(model, "embed", None), getattr(model, "head", None)
    tied = embed is not None and head is not None and head.weight is embed.weight
    for name, module in list(model.named_modules()):
        kind = TP_PLAN.get(_LAYER_PREFIX.sub("", name))
        if kind is None:
            continue
        new = _parallel_module(kind, module, cfg, dims, sequence_parallel)
        if new is not None:
            parent_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent_name), leaf, new)
    if tied:  # both are split by vocab rows the same way, so the shards stay one tensor
        model.head.weight = model.embed.weight


def _parallel_module(kind: str, module: nn.Module, cfg: ModelConfig, dims: ParallelDims,
                     sequence_parallel: bool) -> nn.Module | None:
    """The replacement for one module (None: modified in place or left alone)."""
    if kind == "vocab":
        return VocabParallelEmbedding.from_embedding(module, dims, sequence_parallel=sequence_parallel)
    if kind == "head":
        return ColumnParallelLinear.from_linear(module, dims, sequence_parallel=sequence_parallel)
    if kind == "column" or (kind == "kv" and cfg.kv_heads % dims.tp == 0):
        return ColumnParallelLinear.from_linear(module, dims, sequence_parallel=sequence_parallel,
                                                enter_region=False)
    if kind == "kv":
        return ReplicatedKVLinear.from_linear(module, dims, head_dim=cfg.head_dim)
    if kind == "row":
        return RowParallelLinear.from_linear(module, dims, sequence_parallel=sequence_parallel)
    if kind == "experts":
        return _shard_experts(module, dims)
    if kind == "region" and isinstance(module, MoE):
        module.expert_region = ExpertRegion(dims, sequence_parallel)
    elif kind == "router" and sequence_parallel:
        module.register_forward_hook(_GatherRouterLogits(dims))
        module.tp_partial_grads = ("weight",)
    elif kind == "region":
        module.register_forward_pre_hook(_EnterRegion(dims, sequence_parallel))
    elif kind == "qk_norm":
        module.tp_partial_grads = ("weight",)
    elif kind == "norm" and sequence_parallel:
        module.tp_partial_grads = tuple(n for n, _ in module.named_parameters(recurse=False))
    elif kind == "position" and sequence_parallel:
        new = SequenceParallelPositionEmbedding(module.num_embeddings, module.embedding_dim, dims=dims,
                                                device=module.weight.device, dtype=module.weight.dtype)
        _copy_shards(new, module)
        return new
    return None


def tp_partial_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(global name, parameter) of every tp-partial parameter, in module order."""
    out, seen = [], set()
    for mod_name, module in model.named_modules():
        for p_name in getattr(module, "tp_partial_grads", ()):
            p = getattr(module, p_name)
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append((f"{mod_name}.{p_name}" if mod_name else p_name, p))
    return out


def sync_tp_partial_grads(model: nn.Module, dims: ParallelDims) -> None:
    """Sum the gradients of tp-partial parameters over tp, so every tp rank holds the full gradient.
    Call once per optimizer step, after the last backward and before clipping or the dp all-reduce."""
    params = [p for _, p in tp_partial_params(model) if p.grad is not None]
    allreduce_grads(params, dims.tp_group)
