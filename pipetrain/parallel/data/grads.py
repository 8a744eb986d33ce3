"""Gradient synchronisation and global-norm clipping across every parallel dimension.

After backward each rank holds gradients that are, per parameter kind:
- tp-partial (replicated over tp but each tp rank computed only part): summed over tp;
- a tied embedding split across the first and last pipeline stage: summed over the embed group;
- per dp replica: summed over dp (the loss is already normalised by the global token count); under
  expert parallelism (dims.ep > 1) an expert's gradient sums over the expert-dp group instead (the ranks
  holding the same experts: the all-to-all already summed the tokens of its ep group into it). Under
  context parallelism each cp rank's gradients cover its slice of the tokens, so "dp" is dp x cp
  (dims.dp_cp_group) and an expert's group expert-dp x cp (dims.expert_dp_cp_group): an ep group lies
  inside one cp coordinate, so its all-to-all summed only that cp rank's tokens.
The first two are model-parallel syncs (sync_model_parallel_grads); the dp reduction is done here
for parallel.zero = 0 and by pipetrain.parallel.data.zero (bucketed reduce-scatter) for zero >= 1.

The global norm counts every parameter once: tp shards are summed over tp, tp-replicated tensors are
counted on their own, pipeline stages are summed over pp, and the last stage's copy of a tied
embedding is left out (the first stage counts it); with ep > 1 the experts' squares are summed over
the ep group (each ep rank holds other experts) and then counted as tp shards. Under ZeRO each dp rank holds only its rows of
every gradient, so the partial sums are also summed over dp (global_grad_norm(..., dp_sharded=True)).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn as nn

from pipetrain.models.init import param_layout
from pipetrain.models.moe import Experts
from pipetrain.parallel.mesh.comm import all_reduce_
from pipetrain.parallel.data.allreduce import allreduce_grads
from pipetrain.parallel.tensor.layers import sync_tp_partial_grads, tp_partial_params


def tied_copy_names(model: nn.Module) -> set[str]:
    """Names of parameters that duplicate one held by another pipeline stage (the tied head copy)."""
    cfg = getattr(model, "cfg", None)
    if cfg is not None and cfg.tied and getattr(model, "embed", None) is None and getattr(model, "head", None) is not None:
        return {"head.weight"}
    return set()


def is_tp_replicated(global_shape: tuple[int, ...], local_shape: tuple[int, ...]) -> bool:
    """A parameter whose local tensor is the whole global tensor is replicated over tp (its norm is
    counted on one tp rank's worth); anything else is a tp shard (summed over tp)."""
    return tuple(global_shape) == tuple(local_shape)


def expert_param_ids(model: nn.Module) -> set[int]:
    """ids of the experts' stacked weights (pipetrain.models.moe.Experts): sharded over ep when dims.ep > 1."""
    return {id(p) for m in model.modules() if isinstance(m, Experts) for p in m.parameters(recurse=False)}


def model_parallel_synced_params(model: nn.Module, dims) -> list[nn.Parameter]:
    """Parameters whose gradients sync_model_parallel_grads changes: tp-partial ones (tp > 1) and the
    tied embedding split across pipeline stages (pp > 1). A dp reduction of these must come after it."""
    out = []
    if dims.tp > 1:
        out += [p for _, p in tp_partial_params(model)]
    tied = _tied_param(model) if dims.pp > 1 else None
    if tied is not None and all(tied is not p for p in out):
        out.append(tied)
    return out


def sync_model_parallel_grads(model: nn.Module, dims) -> None:
    """Sum tp-partial gradients over tp and the split tied embedding's over the embed group."""
    if dims.tp > 1:
        sync_tp_partial_grads(model, dims)
    if dims.pp > 1 and getattr(dims, "embed_group", None) is not None:
        tied = _tied_param(model)
        if tied is not None and tied.grad is not None:
            all_reduce_(tied.grad, dims.embed_group)


def sync_grads(model: nn.Module, dims, dp_group="dp") -> None:
    """Make every gradient the full single-process gradient of its (shard of the) parameter; dp_group
    ("dp": dims.dp_group) is the data-parallel group summed over (a relaxed run's dp_shard group)."""
    sync_model_parallel_grads(model, dims)
    group = dims.dp_group if dp_group == "dp" else dp_group
    if group is None and getattr(dims, "ep", 1) == 1:  # one replica: nothing to sum (and no walk over the model)
        return
    params = [p for p in model.parameters() if p.grad is not None]
    if getattr(dims, "ep", 1) > 1:  # experts: over the ranks holding the same experts (and cp: other tokens)
        experts = expert_param_ids(model)
        allreduce_grads([p for p in params if id(p) in experts], dims.expert_dp_cp_group)
        params = [p for p in params if id(p) not in experts]
    if group is not None:
        allreduce_grads(params, group)


def _tied_param(model: nn.Module) -> nn.Parameter | None:
    """The tied embedding on a stage that holds only one end of it (embed without head or vice versa)."""
    cfg = getattr(model, "cfg", None)
    if cfg is None or not cfg.tied:
        return None
    embed, head = getattr(model, "embed", None), getattr(model, "head", None)
    if embed is not None and head is None:
        return embed.weight
    if embed is None and head is not None:
        return head.weight
    return None


class GradNormGroups:
    """The parameters of a gradient norm sorted once by how their squares are summed (sq_norms):
    tp-sharded, tp-replicated and, with dims.ep > 1, experts; the tied head copy is left out. Sorting
    walks every module (param_layout), which is host time a step should not spend (docs/benchmarks.md,
    "Host time of a step"), so an optimizer holds one for its fixed parameters."""

    def __init__(self, model: nn.Module, dims=None):
        params = dict(model.named_parameters())
        skip = tied_copy_names(model)
        self.ep = getattr(dims, "ep", 1) > 1
        experts = expert_param_ids(model) if self.ep else set()
        self.device = next(iter(params.values())).device
        self.sharded, self.replicated, self.experts = [], [], []
        for name, (shape, _) in param_layout(model).items():
            p = params[name]
            if name in skip:
                continue
            if id(p) in experts:
                self.experts.append(p)
            elif is_tp_replicated(shape, p.shape):
                self.replicated.append(p)
            else:
                self.sharded.append(p)

    def sq_norms(self, dims=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of squares over tp-sharded grads, over tp-replicated grads) of this rank's parameters, on the
        device with no host read; with dims.ep > 1 the experts' squares are first summed over the ep group
        (each rank holds other experts)."""
        sharded = sum_sq(_grads(self.sharded), self.device)
        if self.ep:  # the same on every ep rank afterwards; F-sharded under tp, so summed over tp with the shards
            sharded = sharded + all_reduce_(sum_sq(_grads(self.experts), self.device), dims.ep_group)
        return sharded, sum_sq(_grads(self.replicated), self.device)


def _grads(params: list[nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad.detach() for p in params if p.grad is not None]


def sum_sq(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of grads, fp32, on device: one foreach norm over the fp32 ones (a launch or two, not three
    per tensor), each other dtype cast to fp32 first. ZeRO sums its rows with it too (the same bits at dp 1).
    On the CPU the foreach norm accumulates in fp64: its fp32 sum drifts with a tensor's size (4.6e-6 relative
    over 512K elements), so ZeRO's halves of a row-split gradient and the whole one gave norms 3e-5 apart at
    a vocabulary of 8192; CUDA's blocked fp32 reduction does not drift so."""
    fp32 = [g for g in grads if g.dtype == torch.float32]
    total = torch.zeros((), dtype=torch.float32, device=device)
    if fp32:
        wide = torch.float64 if device.type == "cpu" else None
        total = torch.stack(torch._foreach_norm(fp32, 2, dtype=wide)).square().sum().float()
    for g in grads:
        if g.dtype != torch.float32:
            total = total + g.float().square().sum()
    return total


def global_grad_norm_tensor(sharded: torch.Tensor, replicated: torch.Tensor, dims, dp_sharded: bool = False,
                            shard_group="dp", extra_sq: float = 0.0) -> torch.Tensor:
    """The global L2 norm, a 0-dim fp32 tensor on the device (no host read), from this rank's sums of
    squares over tp-sharded and tp-replicated grads.

    dp_sharded: each dp rank holds different rows (ZeRO), so both sums are first summed over dp;
    without it every dp rank holds the same full gradients and dp is not summed (no double count).
    shard_group: the group the rows are split over ("dp": dims.dp_group; ZeRO passes its dp_shard group).
    extra_sq: squares of gradients held elsewhere, counted once per (dp, pp) coordinate: the parameter
    servers' table (pipetrain.parallel.ps.server), which the first stage's tp rank 0 of every dp rank passes."""
    group = dims.dp_group if shard_group == "dp" else shard_group
    if dp_sharded and group is not None:
        both = all_reduce_(torch.stack([sharded, replicated]), group)
        sharded, replicated = both[0], both[1]
    if extra_sq:
        sharded = sharded + extra_sq
    if dims.tp > 1:
        sharded = all_reduce_(sharded.clone(), dims.tp_group)
    total = sharded + replicated
    if dims.pp > 1:
        all_reduce_(total, dims.pp_group)
    return total.sqrt()


def global_grad_norm(sharded: torch.Tensor, replicated: torch.Tensor, dims, dp_sharded: bool = False,
                     shard_group="dp", extra_sq: float = 0.0) -> float:
    """global_grad_norm_tensor read to the host (a synchronisation on a GPU)."""
    return float(global_grad_norm_tensor(sharded, replicated, dims, dp_sharded, shard_group, extra_sq))


def clip_coefficient(norm: float, max_norm: float) -> float | None:
    """The factor gradients are scaled by, or None when no clipping applies (max_norm 0 disables)."""
    if max_norm > 0 and norm > max_norm:
        return max_norm / (norm + 1e-6)
    return None


def clip_divisor(norm: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """What a fused optimizer's grad_scale divides the gradients by to clip them, on the device (no host
    read): (norm + 1e-6) / max_norm where norm > max_norm, else 1; None when max_norm <= 0 disables clipping.
    Dividing by it is clip_coefficient's multiply, to round-off, without a pass of its own over the gradients."""
    if max_norm <= 0:
        return None
    return torch.where(norm > max_norm, (norm.double() + 1e-6) / max_norm, 1.0).float()


def step_on_device(torch_opts: Sequence[torch.optim.Optimizer], step: Callable[[], None], norm: torch.Tensor,
                   max_norm: float, loss_sum: torch.Tensor) -> None:
    """Run step() (the updates by torch_opts, fused AdamWs) clipped and checked with no host read: each fused
    kernel divides the gradients by clip_divisor(norm) (its grad_scale) and leaves weights, moments and step
    counters as they were when norm or loss_sum is not finite (its found_inf). The caller reads both later."""
    found_inf = (~(torch.isfinite(norm) & torch.isfinite(loss_sum))).float()
    divisor = clip_divisor(norm, max_norm)
    for opt in torch_opts:
        opt.found_inf, opt.grad_scale = found_inf, divisor
    try:
        step()
    finally:
        for opt in torch_opts:
            del opt.found_inf, opt.grad_scale


def clip_grad_norm(model: nn.Module, dims, max_norm: float, extra_sq: float = 0.0,
                   groups: GradNormGroups | None = None) -> float:
    """Global gradient L2 norm over all ranks; scales gradients in place when it exceeds max_norm > 0.
    groups: the model's GradNormGroups, kept by the caller (None: sorted now)."""
    groups = groups if groups is not None else GradNormGroups(model, dims)
    sharded, replicated = groups.sq_norms(dims)
    norm = global_grad_norm(sharded, replicated, dims, extra_sq=extra_sq)
    coef = clip_coefficient(norm, max_norm)
    if coef is not None:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        torch._foreach_mul_(grads, coef)
    return norm
