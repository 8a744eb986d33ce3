"""Collectives for tensor and sequence parallelism, as autograd Functions (Megatron's f and g).

Each Function is the conjugate of another: the forward of one is the backward of the other, so a
tensor-parallel region is entered and left with matching communication in both directions.

    copy_to_tp           forward: identity                  backward: all-reduce over tp      (f)
    reduce_from_tp       forward: all-reduce over tp        backward: identity                (g)
    split_last_dim       forward: keep this rank's chunk    backward: all-gather along -1
    gather_last_dim      forward: all-gather along -1       backward: keep this rank's chunk
    gather_sequence      forward: all-gather along T        backward: reduce-scatter along T
    reduce_scatter_sequence  forward: reduce-scatter along T  backward: all-gather along T

Shapes: B batch, T time (dim 1 of activations), D model; under sequence parallelism a rank holds
(B, T/tp, D). A group of None means a group of one: every operator is then the identity and no
collective is issued (None never means the default world group here).

The three primitives (all_reduce_, all_gather, reduce_scatter) are the only places that call
torch.distributed collectives, so a benchmark can wrap them to count bytes. reduce_scatter probes the
backend at first use: older gloo builds lack reduce_scatter, and then it falls back to all_reduce +
slice (same result, tp times the received bytes). The probe result is cached per (backend, dtype) in
_NATIVE_REDUCE_SCATTER, the module's only mutable state; it is a fact about the installed backend, not
run configuration. Point-to-point helpers for pipelining live with the pipeline code.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

ProcessGroup = Optional[dist.ProcessGroup]

# (backend name, dtype) -> whether the backend's reduce_scatter works; filled at first use.
_NATIVE_REDUCE_SCATTER: dict[tuple[str, torch.dtype], bool] = {}


def _all_gather_into(out, x, group):
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single; older releases have only the former.
    return getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, x, group=group)


def _reduce_scatter_into(out, x, op, group):
    return getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, x, op=op, group=group)


def _fresh(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy that a collective may overwrite in place (autograd inputs must not change)."""
    return x.clone(memory_format=torch.contiguous_format)


def group_size(pg: ProcessGroup) -> int:
    """Ranks in pg; 1 for None."""
    return 1 if pg is None else dist.get_world_size(pg)


def group_rank(pg: ProcessGroup) -> int:
    """This process's rank within pg; 0 for None."""
    return 0 if pg is None else dist.get_rank(pg)


# ---- primitives: the only callers of torch.distributed collectives ----

def all_reduce_(x: torch.Tensor, pg: ProcessGroup) -> torch.Tensor:
    """Sum x over pg in place and return it."""
    if group_size(pg) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=pg)
    return x


def all_gather(x: torch.Tensor, dim: int, pg: ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's x along dim, in rank order (every rank's x has the same shape)."""
    n = group_size(pg)
    if n == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()  # collectives concatenate along dim 0
    out = torch.empty((n * moved.shape[0],) + tuple(moved.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_into(out, moved, group=pg)
    return out.movedim(0, dim).contiguous()


def reduce_scatter(x: torch.Tensor, dim: int, pg: ProcessGroup, native: bool | None = None) -> torch.Tensor:
    """Sum x over pg and keep this rank's chunk of x.shape[dim] / n along dim.

    native=None uses the backend's reduce_scatter when the first-use probe found it working, else
    all_reduce + slice; True/False force one path (tests compare them).
    """
    n = group_size(pg)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"reduce_scatter: dim {dim} of shape {tuple(x.shape)} is not divisible by the "
                         f"group size {n}; make the sequence length a multiple of tp")
    key = (str(dist.get_backend(pg)), x.dtype)
    if native is None:
        native = _NATIVE_REDUCE_SCATTER.get(key, True)
    if native:
        moved = x.movedim(dim, 0).contiguous()
        out = torch.empty((moved.shape[0] // n,) + tuple(moved.shape[1:]), dtype=x.dtype, device=x.device)
        try:
            _reduce_scatter_into(out, moved, op=dist.ReduceOp.SUM, group=pg)
            _NATIVE_REDUCE_SCATTER[key] = True
            return out.movedim(0, dim).contiguous()
        except (RuntimeError, NotImplementedError):
            # The backend rejects the op locally before any data moves, identically on every rank of
            # the group (same backend, same dtype), so all of them take the fallback together.
            if key in _NATIVE_REDUCE_SCATTER:
                raise
            _NATIVE_REDUCE_SCATTER[key] = False
    # Fallback: the full sum on every rank, then this rank's slice.
    summed = all_reduce_(_fresh(x), pg)
    chunk = x.shape[dim] // n
    return summed.narrow(dim, group_rank(pg) * chunk, chunk).contiguous()


def _chunk(x: torch.Tensor, dim: int, pg: ProcessGroup) -> torch.Tensor:
    n = group_size(pg)
    if x.shape[dim] % n:
        raise ValueError(f"split: dim {dim} of shape {tuple(x.shape)} is not divisible by the group size {n}")
    chunk = x.shape[dim] // n
    return x.narrow(dim, group_rank(pg) * chunk, chunk).contiguous()


# ---- autograd Functions ----

class _CopyToTP(torch.autograd.Function):
    """forward: identity; backward: all-reduce over tp (each rank holds a partial input gradient)."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return all_reduce_(_fresh(dy), ctx.pg), None


class _ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce over tp (sum of partial outputs); backward: identity (the gradient of a sum
    is replicated)."""

    @staticmethod
    def forward(ctx, x, pg):
        return all_reduce_(_fresh(x), pg)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _SplitLastDim(torch.autograd.Function):
    """forward: keep this rank's chunk of the last dim; backward: all-gather along the last dim."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return _chunk(x, -1, pg)

    @staticmethod
    def backward(ctx, dy):
        return all_gather(dy, -1, ctx.pg), None


class _GatherLastDim(torch.autograd.Function):
    """forward: all-gather along the last dim; backward: keep this rank's chunk of the last dim."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return all_gather(x, -1, pg)

    @staticmethod
    def backward(ctx, dy):
        return _chunk(dy, -1, ctx.pg), None


class _GatherSequence(torch.autograd.Function):
    """forward: all-gather (B, T/tp, D) -> (B, T, D) along T; backward: reduce-scatter along T (the
    gathered tensor feeds column-parallel layers, so each rank holds a partial gradient of all of T)."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return all_gather(x, 1, pg)

    @staticmethod
    def backward(ctx, dy):
        return reduce_scatter(dy, 1, ctx.pg), None


class _ReduceScatterSequence(torch.autograd.Function):
    """forward: reduce-scatter (B, T, D) partial sums -> (B, T/tp, D) along T; backward: all-gather
    along T (the gradient of this rank's slice of a sum is that slice of the replicated gradient)."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return reduce_scatter(x, 1, pg)

    @staticmethod
    def backward(ctx, dy):
        return all_gather(dy, 1, ctx.pg), None


def copy_to_tp(x: torch.Tensor, tp_group: ProcessGroup) -> torch.Tensor:
    """f: forward identity, backward all-reduce over tp."""
    return x if group_size(tp_group) == 1 else _CopyToTP.apply(x, tp_group)


def reduce_from_tp(x: torch.Tensor, tp_group: ProcessGroup) -> torch.Tensor:
    """g: forward all-reduce over tp, backward identity."""
    return x if group_size(tp_group) == 1 else _ReduceFromTP.apply(x, tp_group)


def split_last_dim(x: torch.Tensor, tp_group: ProcessGroup) -> torch.Tensor:
    """forward: this rank's chunk of the last dim; backward: all-gather along the last dim."""
    return x if group_size(tp_group) == 1 else _SplitLastDim.apply(x, tp_group)


def gather_last_dim(x: torch.Tensor, tp_group: ProcessGroup) -> torch.Tensor:
    """forward: all-gather along the last dim; backward: this rank's chunk of the last dim."""
    return x if group_size(tp_group) == 1 else _GatherLastDim.apply(x, tp_group)


def gather_sequence(x: torch.Tensor, tp_group: ProcessGroup) -> torch.Tensor:
    """forward: all-gather along T, (B, T/tp, D) -> (B, T, D); backward: reduce-scatter along T."""
    return x if group_size(tp_group) == 1 else _GatherSequence.apply(x, tp_group)


def reduce_scatter_sequence(x: torch.Tensor, tp_group: ProcessGroup) -> torch.Tensor:
    """forward: reduce-scatter along T, (B, T, D) -> (B, T/tp, D); backward: all-gather along T."""
    return x if group_size(tp_group) == 1 else _ReduceScatterSequence.apply(x, tp_group)


# -- trainer-level reductions
# Whole-world collectives of the training loop and of building a run (the default group: every rank).
# With one process they return their input and issue nothing.

def sum_over_world_(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """Sum x over every rank, in place; returns x."""
    if world_size > 1:
        dist.all_reduce(x)
    return x


def any_over_world(flag: bool, world_size: int, device: torch.device) -> bool:
    """True on every rank when flag is True on any rank."""
    if world_size == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def broadcast_object_from_rank0(obj, world_size: int):
    """Rank 0's obj (picklable) on every rank."""
    if world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(world_size: int) -> None:
    """Wait until every rank reaches this point."""
    if world_size > 1:
        dist.barrier()
