"""Gradient synchronisation and global-norm clipping across every parallel dimension.

After backward each rank holds gradients that are, per parameter kind:
- tp-partial (replicated over tp but each tp rank computed only part): summed over tp;
- a tied embedding split across the first and last pipeline stage: summed over the embed group;
- per dp replica: summed over dp (the loss is already normalised by the global token count).
The global norm counts every parameter once: tp shards are summed over tp, tp-replicated tensors are
counted on their own, pipeline stages are summed over pp, and the last stage's copy of a tied
embedding is left out (the first stage counts it).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from pipetrain.models.init import param_layout


def tied_copy_names(model: nn.Module) -> set[str]:
    """Names of parameters that duplicate one held by another pipeline stage (the tied head copy)."""
    cfg = getattr(model, "cfg", None)
    if cfg is not None and cfg.tied and getattr(model, "embed", None) is None and getattr(model, "head", None) is not None:
        return {"head.weight"}
    return set()


def sync_grads(model: nn.Module, dims) -> None:
    """Make every gradient the full single-process gradient of its (shard of the) parameter."""
    if dims.tp > 1:
        from pipetrain.parallel.tensor import sync_tp_partial_grads
        sync_tp_partial_grads(model, dims)
    if dims.pp > 1 and getattr(dims, "embed_group", None) is not None:
        tied = _tied_grad(model)
        if tied is not None:
            dist.all_reduce(tied, group=dims.embed_group)
    if dims.dp > 1 and not getattr(model, "grads_reduced_by_optimizer", False):
        from pipetrain.parallel.data_parallel import allreduce_grads
        allreduce_grads([p for p in model.parameters() if p.grad is not None], dims.dp_group)


def _tied_grad(model: nn.Module) -> torch.Tensor | None:
    cfg = getattr(model, "cfg", None)
    if cfg is None or not cfg.tied:
        return None
    if getattr(model, "embed", None) is not None and getattr(model, "head", None) is None:
        return model.embed.weight.grad
    if getattr(model, "embed", None) is None and getattr(model, "head", None) is not None:
        return model.head.weight.grad
    return None


def grad_sq_norms(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of squares over tp-sharded grads, over tp-replicated grads) for this rank's parameters."""
    params = dict(model.named_parameters())
    skip = tied_copy_names(model)
    device = next(iter(params.values())).device
    sharded = torch.zeros((), dtype=torch.float32, device=device)
    replicated = torch.zeros((), dtype=torch.float32, device=device)
    for name, (shape, _) in param_layout(model).items():
        p = params[name]
        if name in skip or p.grad is None:
            continue
        sq = p.grad.detach().float().square().sum()
        if tuple(p.shape) == tuple(shape):
            replicated += sq
        else:
            sharded += sq
    return sharded, replicated


def clip_grad_norm(model: nn.Module, dims, max_norm: float) -> float:
    """Global gradient L2 norm over all ranks; scales gradients in place when it exceeds max_norm > 0."""
    sharded, replicated = grad_sq_norms(model)
    if dims.tp > 1:
        dist.all_reduce(sharded, group=dims.tp_group)
    total = sharded + replicated
    if dims.pp > 1:
        dist.all_reduce(total, group=dims.pp_group)
    norm = float(total.sqrt())
    if max_norm > 0 and norm > max_norm:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
    return norm
