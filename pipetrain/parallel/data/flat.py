"""Flatten -> collective -> copy back: a list of tensors travels through one collective as one flat buffer.

Every exchange of many tensors does this (the bucketed dp all-reduce, ZeRO's rank-major buckets, the
exchanges across replicas under relaxed sync and torchft): one collective over one buffer costs one
latency instead of one per tensor. The three steps are separate functions because the collective may be
asynchronous, run by another library (torchft's Manager), or need its result scaled before the copy back;
reduce_flat_ chains them for the blocking case.

Layouts. Packed: the tensors one after another, in list order (numel sum elements). Placed: tensor i at
offsets[i] in a buffer of `size` elements, offsets increasing, every element no tensor covers zero (ZeRO's
padding); a None tensor places nothing (its span stays zero) and is not written back. Copying is exact, so
a round trip through an identity collective returns every tensor bitwise.

Shapes: a flat buffer is (N,), of the tensors' dtype.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch


def flatten(tensors: Sequence[Optional[torch.Tensor]], device: torch.device | None = None, *,
            offsets: Sequence[int] | None = None, size: int | None = None,
            dtype: torch.dtype | None = None) -> torch.Tensor:
    """One flat buffer holding tensors, packed (offsets None) or placed at offsets in size elements.

    device and dtype are needed only when no tensor gives them (an empty list: a rank with nothing to
    exchange still joins the collective, with an empty buffer on the group's device)."""
    if offsets is None:
        assert all(t is not None for t in tensors), "flatten: None tensors need offsets (their span is zero)"
        if not tensors:
            return torch.zeros(0, dtype=dtype or torch.float32, device=device)
        return torch.cat([t.reshape(-1) for t in tensors])
    assert size is not None and len(offsets) == len(tensors), "flatten: offsets need one per tensor and a size"
    first = next((t for t in tensors if t is not None), None)
    flat = torch.empty(size, dtype=dtype or first.dtype, device=device or first.device)
    end = 0  # everything before end is written
    for t, offset in zip(tensors, offsets):
        assert offset >= end, f"flatten: offsets must increase without overlap, got {offset} after {end}"
        if t is None:
            continue
        if offset > end:
            flat[end:offset].zero_()
        flat[offset:offset + t.numel()].copy_(t.reshape(-1))
        end = offset + t.numel()
    flat[end:].zero_()
    return flat


def copy_back_(flat: torch.Tensor, tensors: Sequence[Optional[torch.Tensor]],
               offsets: Sequence[int] | None = None) -> None:
    """Copy each tensor's span of flat (the layout flatten made: packed, or at offsets) into it, in place.
    The tensors may be others than the ones flattened, of the same shapes (relaxed sync installs a clock's
    summed gradient into the gradients of a later clock); None entries (placed layout) are skipped."""
    offset = 0
    for i, t in enumerate(tensors):
        if offsets is not None:
            offset = offsets[i]
        if t is None:
            continue
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


def reduce_flat_(tensors: Sequence[torch.Tensor], collective: Callable[[torch.Tensor], object],
                 device: torch.device | None = None, scale: float | None = None) -> torch.Tensor:
    """Flatten tensors (packed), run collective(flat) in place (waiting on the Work it returns, if any),
    multiply by scale when given, and copy the result back into tensors. Returns the flat buffer."""
    flat = flatten(tensors, device)
    work = collective(flat)
    if hasattr(work, "wait"):
        work.wait()
    if scale is not None:
        flat.mul_(scale)
    copy_back_(flat, tensors)
    return flat
