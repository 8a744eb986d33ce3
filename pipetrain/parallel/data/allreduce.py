"""Data parallelism: sum gradients over the dp group with bucketed all-reduces.

Each dp rank runs the same (possibly tp/pp-sharded) model on its contiguous slice of the global batch.
The trainer divides each rank's loss by the GLOBAL count of target tokens, so the per-rank gradients
are summands of the single-process gradient and the correct reduction is a SUM (averaging would
divide by dp a second time).

Gradients are flattened into buckets of at most bucket_bytes (a parameter larger than that gets a
bucket of its own), one all-reduce per bucket, in the order the parameters are given. That order is
the same on every rank, so the same collectives pair up and the summation is deterministic.
This runs after the last backward of a step (parallel.zero = 0, and tp-partial gradients over tp);
pipetrain.parallel.data.zero overlaps its bucketed reductions with backward instead.

Shapes: a bucket is a flat (N,) tensor of one dtype and device.
"""
from __future__ import annotations

from typing import Iterable

import torch

from pipetrain.parallel.data.flat import reduce_flat_
from pipetrain.parallel.mesh.comm import ProcessGroup, all_reduce_, group_size

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # PyTorch DDP's default: large enough to amortise latency


def grad_buckets(params: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of params with the same dtype and device, each under bucket_bytes of gradient."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        nbytes = p.grad.numel() * p.grad.element_size()
        last = buckets[-1] if buckets else None
        fits = (last is not None and size + nbytes <= bucket_bytes and last[0].grad.dtype == p.grad.dtype
                and last[0].grad.device == p.grad.device)
        if fits:
            last.append(p)
            size += nbytes
        else:
            buckets.append([p])
            size = nbytes
    return buckets


@torch.no_grad()
def allreduce_grads(params: Iterable[torch.Tensor], pg: ProcessGroup,
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
    """Replace each p.grad by its sum over pg (dp_group for data parallelism), bucket by bucket.

    Parameters whose grad is None are skipped; every rank of pg must pass the same parameters in the
    same order with the same grads set (true for replicas of one model), or the collectives mismatch."""
    params = [p for p in params if p.grad is not None]
    if group_size(pg) == 1 or not params:
        return
    for bucket in grad_buckets(params, bucket_bytes):
        reduce_flat_([p.grad for p in bucket], lambda flat: all_reduce_(flat, pg))  # flat (N,)
