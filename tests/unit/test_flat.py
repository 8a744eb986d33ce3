"""pipetrain.parallel.data.flat, the flatten -> collective -> copy back helper: round trips are bitwise, the
placed layout zeroes what no tensor covers and skips None, and the collective's result reaches every tensor."""
from __future__ import annotations

import torch

from pipetrain.parallel.data.flat import copy_back_, flatten, reduce_flat_


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 4, generator=g), torch.randn(5, generator=g), torch.randn(2, 1, 3, generator=g)]


def test_packed_round_trip_is_bitwise_and_in_list_order():
    ts = _tensors()
    flat = flatten(ts)
    assert flat.shape == (12 + 5 + 6,) and torch.equal(flat[12:17], ts[1])
    out = [torch.full_like(t, float("nan")) for t in ts]  # poisoned: an unwritten element shows
    copy_back_(flat, out)
    assert all(torch.equal(a, b) for a, b in zip(ts, out))


def test_copy_back_reaches_non_contiguous_tensors():
    base = torch.zeros(4, 6)
    view = base[:, ::2]  # (4, 3), strided
    copy_back_(torch.arange(12.0), [view])
    assert torch.equal(view, torch.arange(12.0).view(4, 3)) and base[:, 1::2].eq(0).all()


def test_placed_layout_zeroes_gaps_and_skips_none():
    ts = _tensors()
    pieces, offsets = [ts[0], None, ts[2]], [2, 20, 30]
    flat = flatten(pieces, offsets=offsets, size=40)
    assert torch.equal(flat[2:14], ts[0].reshape(-1)) and torch.equal(flat[30:36], ts[2].reshape(-1))
    covered = torch.zeros(40, dtype=torch.bool)
    covered[2:14] = covered[30:36] = True
    assert flat[~covered].eq(0).all()  # the head, the None piece's span, the gap and the tail
    out = [torch.full_like(ts[0], float("nan")), None, torch.full_like(ts[2], float("nan"))]
    copy_back_(flat, out, offsets)
    assert torch.equal(out[0], ts[0]) and torch.equal(out[2], ts[2])


def test_empty_list_gives_an_empty_buffer_on_the_asked_device():
    flat = flatten([], torch.device("meta"))
    assert flat.numel() == 0 and flat.device.type == "meta" and flat.dtype == torch.float32


def test_reduce_flat_copies_the_collectives_result_back_scaled():
    ts = _tensors()
    before = [t.clone() for t in ts]
    seen = []

    def collective(flat):  # a sum with one identical peer, then a Work to wait on
        seen.append(flat.numel())
        flat.mul_(2)
        return type("Work", (), {"wait": lambda self: seen.append("waited")})()
    reduce_flat_(ts, collective, scale=0.5)
    assert seen == [23, "waited"]
    assert all(torch.equal(a, b) for a, b in zip(ts, before))  # x * 2 * 0.5 is exact
