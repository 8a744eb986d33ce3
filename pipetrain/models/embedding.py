"""Embedding whose weight gradient is accumulated in place under fuse_grad_accumulation.

Plain autograd's embedding backward builds a dense (V, D) gradient, zeroes it, scatters the rows of dy
into it and then adds the whole of it to .grad: two passes over V x D values for a microbatch that
touches B*T rows. Inside `fuse_grad_accumulation()` (pipetrain.models.linear) the backward adds the
rows of dy into .grad directly (index_add_); the first microbatch of a step allocates the zeroed
gradient, as plain autograd does. The AccumulateGrad node then runs with nothing to add and fires
the post-accumulate-grad hooks, as for the fused linear. Outside the context, or with padding_idx,
max_norm or sparse gradients, it is plain F.embedding.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipetrain.models.linear import fusing


class _EmbeddingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        with torch.no_grad():
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight, memory_format=torch.contiguous_format)
            weight.grad.index_add_(0, ids.reshape(-1), dy.reshape(-1, weight.shape[1]).to(weight.dtype))
        return None, None


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.embedding(ids, weight), with the gradient added into weight.grad in place when fusing."""
    if fusing() and torch.is_grad_enabled() and weight.requires_grad and weight.is_leaf:
        return _EmbeddingFn.apply(ids, weight)
    return F.embedding(ids, weight)


class Embedding(nn.Embedding):
    """nn.Embedding (same parameter and state-dict name) with the fused gradient accumulation above."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.padding_idx is not None or self.max_norm is not None or self.sparse:
            return super().forward(ids)
        return embedding(ids, self.weight)
