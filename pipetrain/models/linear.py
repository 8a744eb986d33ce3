"""Linear layers and how their weight gradients are produced: accumulated in place, or deferred.

A backward through y = x W^T + b computes two things: the input gradient dx = dy W, which the layers
before (and the previous pipeline stage) wait for, and the weight gradients dW = dy^T x and db = sum(dy),
which nobody needs until the optimizer step. Plain autograd computes dW into a new tensor and then adds
it to .grad: for each of a step's microbatches after the first, one more pass over every weight's
gradient (the head's V x D matrix included). Two modes, each entered with a context manager around the
forward (bound at forward time, so a backward needs no global state; CUDA runs backwards on other
threads) and around the backward (activation recomputation re-runs the forward there):

- `fuse_grad_accumulation(min_numel=...)`: gradient accumulation fusion (Megatron-LM's name), for weights
  of at least min_numel elements (default FUSE_MIN_NUMEL; below that the Python Function costs more than
  the pass it saves; the recipe's train.grad_accumulation_fusion_min_numel).
  The backward computes dx and adds dW straight into .grad with one GEMM (addmm_, beta = 1), b's into its .grad; it returns no
  gradient for W and b, so their AccumulateGrad nodes run with nothing to add and fire the
  post-accumulate-grad hooks (ZeRO-2's overlapped reduction) once per backward, after every use of the
  weight has been added (a tied weight too). The pipeline executor runs every F and B inside it by
  default (`train.grad_accumulation_fusion`). The sum is the same; rounding differs from plain autograd
  (add-into-GEMM against GEMM-then-add) at fp32 round-off, and every layout accumulates the same
  microbatches in the same order, so layouts still agree with each other bit for bit.
- `defer_weight_grads(work)`: the split backward of zero-bubble pipelining. The layer has no graph edge to
  its weight or bias: the backward computes only dx and appends (weight, bias, x, dy) to `work`;
  `apply_weight_grads(work)` later does the same in-place accumulation and fires the hooks, when the
  executor reaches the schedule's W action. Only the time moves (tests/unit/test_linear.py).

Outside both contexts `linear` is plain F.linear; so is a weight that is not a leaf parameter (a slice
of one, as ReplicatedKVLinear uses), and, when deferring, an input that needs no gradient.

Mixed precision: under torch.autocast the matmuls run in the autocast dtype, as autocast runs F.linear
(operands cast down, gradients cast back to the parameters' dtype: added with add_, since addmm_ cannot
mix dtypes); x is saved in the cast dtype, so the saved bytes equal plain autocast's.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

WeightGradWork = list  # of (weight, bias | None, x (N, D_in), dy (N, D_out)): one entry per linear call

# Module state, which STYLE.md otherwise rules out: the executor sets it around a chunk's forward and
# the layers read it, so the model stays blind to pipelining instead of taking a mode argument in
# every module; only the context managers below change it, and always restore it.
_deferring: WeightGradWork | None = None  # set by defer_weight_grads
_fuse_min_numel: int | None = None  # set by fuse_grad_accumulation; None: not fusing
# Fusion pays where the saved pass over .grad outweighs the custom autograd Function's Python overhead
# (tens of us per forward + backward on the 2-vCPU CI machine): from about a million elements
# (benchmarks/grad_accumulation.py: a 256 x 256 weight is slower fused, the 8192 x 256 head faster).
FUSE_MIN_NUMEL = 1 << 20


@contextlib.contextmanager
def defer_weight_grads(work: WeightGradWork) -> Iterator[WeightGradWork]:
    """Linear layers run forward inside append their weight-gradient work to `work` at backward time."""
    global _deferring
    outer, _deferring = _deferring, work
    try:
        yield work
    finally:
        _deferring = outer


@contextlib.contextmanager
def fuse_grad_accumulation(enabled: bool = True, min_numel: int | None = None) -> Iterator[None]:
    """Linear layers of at least min_numel weight elements (default FUSE_MIN_NUMEL), and every
    pipetrain.models.embedding, run forward inside add their weight gradients straight into .grad at
    backward time."""
    global _fuse_min_numel
    outer = _fuse_min_numel
    _fuse_min_numel = (FUSE_MIN_NUMEL if min_numel is None else min_numel) if enabled else None
    try:
        yield
    finally:
        _fuse_min_numel = outer


def fusing() -> bool:
    return _fuse_min_numel is not None


def _fuses(weight: torch.Tensor) -> bool:
    return _fuse_min_numel is not None and weight.numel() >= _fuse_min_numel


def add_to_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """param.grad += grad in place (or param.grad = grad), cast to the parameter's dtype."""
    if param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad.add_(grad)


def _add_matmul_to_grad(param: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """param.grad += a @ b: one GEMM that reads and writes .grad (beta = 1) when the dtypes agree."""
    if param.grad is not None and a.dtype == param.grad.dtype:
        param.grad.addmm_(a, b)
    else:
        add_to_grad(param, a.mm(b))


def _accumulate(weight, bias, x2: torch.Tensor, dy2: torch.Tensor) -> None:
    """Under no_grad (a backward runs so)."""
    _add_matmul_to_grad(weight, dy2.t(), x2)  # dW = dy^T x, as autograd's mm backward computes it
    if bias is not None:
        add_to_grad(bias, dy2.sum(0))


class _RunHooks(torch.autograd.Function):
    """A graph whose backward runs the leaves' AccumulateGrad nodes with no gradient: nothing is added,
    their post-accumulate-grad hooks fire (tests/unit/test_linear.py checks both)."""

    @staticmethod
    def forward(ctx, *leaves):
        return torch.zeros((), device=leaves[0].device)

    @staticmethod
    def backward(ctx, _):
        return (None,) * len(ctx.needs_input_grad)


def run_grad_hooks(leaves) -> None:
    """Fire the post-accumulate-grad hooks of leaves whose .grad was updated in place, outside a backward."""
    leaves = [p for p in leaves if p is not None and p.requires_grad]
    if leaves:
        with torch.enable_grad():
            _RunHooks.apply(*leaves).backward()


def apply_weight_grads(work: WeightGradWork) -> None:
    """Add the recorded weight gradients into .grad in place, fire their hooks, then empty `work`."""
    leaves = []
    with torch.no_grad():
        for weight, bias, x2, dy2 in work:
            _accumulate(weight, bias, x2, dy2)
            leaves += [weight, bias]
    work.clear()
    run_grad_hooks(leaves)


class _LinearFn(torch.autograd.Function):
    """y = x W^T + b whose backward returns only dx and either adds dW, db into .grad now (work None:
    W and b are the leaves themselves, so the graph reaches their AccumulateGrad nodes, which then fire
    the hooks) or records them in `work` (W and b arrive detached: no edge, nothing fires until W)."""

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
        dy2, x2 = dy.reshape(-1, weight.shape[0]), x.reshape(-1, weight.shape[1])
        if dy2.dtype != x.dtype:
            dy2 = dy2.to(x.dtype)
        if ctx.work is None:
            _accumulate(*ctx.leaves, x2, dy2)
        else:
            ctx.work.append((*ctx.leaves, x2, dy2))
        dx = None
        if ctx.needs_input_grad[0]:
            dx = dy2.mm(weight if weight.dtype == x.dtype else weight.to(x.dtype)).view(*dy.shape[:-1], weight.shape[1])
        return dx, None, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with the weight gradients deferred or accumulated in place (module docstring)."""
    work = _deferring
    if (work is None and not _fuses(weight)) or not torch.is_grad_enabled() \
            or not (weight.requires_grad and weight.is_leaf) or not (bias is None or (bias.requires_grad and bias.is_leaf)):
        return F.linear(x, weight, bias)
    if work is not None and x.requires_grad:
        return _LinearFn.apply(x, weight.detach(), None if bias is None else bias.detach(), (weight, bias), work)
    if _fuses(weight):
        return _LinearFn.apply(x, weight, bias, (weight, bias), None)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict names) whose weight gradients can be deferred or
    accumulated in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
