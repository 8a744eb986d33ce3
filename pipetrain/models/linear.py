"""Linear layers whose weight gradients can be deferred: the split backward of zero-bubble pipelining.

A backward through y = x W^T + b computes two things: the input gradient dx = dy W, which the previous
pipeline stage is waiting for, and the weight gradients dW = dy^T x and db = sum(dy), which nobody needs
until the optimizer step. A forward run inside `defer_weight_grads(work)` builds its linear layers
without a graph edge to their weight and bias: their backward computes only dx and appends
(weight, bias, x, dy) to `work`. `apply_weight_grads(work)` computes those dW and db later, when the
pipeline executor reaches the schedule's W action for that microbatch. The numbers are the ones plain
autograd computes, bit for bit (same matmuls on the same operands, tests/unit/test_linear.py); only
the time moves. They are accumulated through autograd (backward on the leaf parameters), so
post-accumulate-grad hooks (ZeRO-2's overlapped reduction) fire once per microbatch, as without
deferral, and never during the input-gradient pass.

The work list is bound at forward time, so a backward needs no global state (CUDA runs it on other
threads). Activation recomputation re-runs the forward inside the backward: run the backward inside
the same `defer_weight_grads(work)` so the recomputed layers take the same path. Outside the
context `linear` is plain F.linear; so is a weight that is not a leaf parameter (a slice of one,
as ReplicatedKVLinear uses) or an input that needs no gradient.

Mixed precision: under torch.autocast the matmuls run in the autocast dtype, as autocast runs
F.linear (operands cast down, gradients cast back to the parameters' dtype); x is saved in the cast
dtype, so the saved bytes equal plain autocast's.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

WeightGradWork = list  # of (weight, bias | None, x (N, D_in), dy (N, D_out)): one entry per linear call

_deferring: WeightGradWork | None = None  # set by defer_weight_grads


@contextlib.contextmanager
def defer_weight_grads(work: WeightGradWork) -> Iterator[WeightGradWork]:
    """Linear layers run forward inside append their weight-gradient work to `work` at backward time."""
    global _deferring
    outer, _deferring = _deferring, work
    try:
        yield work
    finally:
        _deferring = outer


def apply_weight_grads(work: WeightGradWork) -> None:
    """Compute the recorded weight gradients and accumulate them into .grad, then empty `work`."""
    leaves, grads = [], []
    for weight, bias, x2, dy2 in work:
        leaves.append(weight)
        grads.append(dy2.t().mm(x2).to(weight.dtype))  # dW = dy^T x, as autograd's mm backward computes it
        if bias is not None:
            leaves.append(bias)
            grads.append(dy2.sum(0).to(bias.dtype))
    work.clear()
    if leaves:
        torch.autograd.backward(leaves, grads)  # leaf roots: accumulates into .grad and runs grad hooks


class _DeferredLinearFn(torch.autograd.Function):
    """y = x W^T + b with a graph edge only to x; W and b arrive detached, their leaves ride on ctx."""

    @staticmethod
    def forward(ctx, x, weight, bias, leaves, work):
        device = x.device.type
        if torch.is_autocast_enabled(device):  # what autocast does to F.linear, done here so x is saved cast
            x = x.to(torch.get_autocast_dtype(device))
            with torch.autocast(device, enabled=False):
                out = F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
        else:
            out = F.linear(x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.leaves, ctx.work = leaves, work
        return out

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, weight.shape[0]).to(x.dtype)
        ctx.work.append((*ctx.leaves, x.reshape(-1, weight.shape[1]), dy2))
        dx = dy2.mm(weight.to(x.dtype)).view(*dy.shape[:-1], weight.shape[1])
        return dx, None, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with the weight gradients deferred inside defer_weight_grads (module docstring)."""
    work = _deferring
    if (work is None or not torch.is_grad_enabled() or not x.requires_grad or not weight.requires_grad
            or not weight.is_leaf or (bias is not None and not (bias.is_leaf and bias.requires_grad))):
        return F.linear(x, weight, bias)
    return _DeferredLinearFn.apply(x, weight.detach(), None if bias is None else bias.detach(), (weight, bias), work)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict names) whose weight gradients can be deferred."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
