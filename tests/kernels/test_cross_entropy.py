"""cross_entropy: reference against F.cross_entropy, gradcheck, and the vocab-parallel path at tp=2."""
import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipetrain.kernels import cross_entropy
from pipetrain.kernels.cross_entropy import cross_entropy_ref
from tests.harness import run_ranks

# Vocab-parallel splits the max / sum-exp reduction over V into tp partial reductions, so fp32 differs
# from the unsharded one by summation-order round-off only.
TP_FP32 = dict(rtol=1e-5, atol=1e-6)


def _fresh_seed() -> int:
    return random.SystemRandom().randrange(2**31)


def _problem(seed, n, vocab, dtype, ignore_index=-100):
    """Logits (n, vocab) with a spread of magnitudes, targets hitting every shard plus some ignored."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=g) * 3).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=g)
    if n > 1:
        targets[torch.rand(n, generator=g) < 0.25] = ignore_index
        targets[0] = vocab - 1  # last row of the last shard
    return logits, targets


def _check_vocab_parallel(rank, world_size, seed, n, vocab, dtype_name, ignore_index):
    dtype = getattr(torch, dtype_name)
    logits, targets = _problem(seed, n, vocab, dtype, ignore_index)
    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full.float(), targets, ignore_index=ignore_index)
    want.backward()
    v_local = vocab // world_size
    shard = logits[:, rank * v_local:(rank + 1) * v_local].clone().requires_grad_()  # (N, V/tp)
    got = cross_entropy(shard.view(1, n, v_local), targets.view(1, n), ignore_index=ignore_index,
                        tp_group=dist.group.WORLD)
    got.backward()
    where = f"[rank {rank} | tp {rank}] seed={seed} {dtype_name}"
    assert got.dtype == torch.float32, f"{where}: loss dtype {got.dtype}"
    torch.testing.assert_close(got, want, **TP_FP32, msg=lambda m: f"{where} loss: {m}")
    # bf16 grads are fp32 grads rounded once; round-off in the fp32 ones may flip that rounding by 1 ulp.
    tol = TP_FP32 if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-6)
    want_grad = full.grad[:, rank * v_local:(rank + 1) * v_local]
    torch.testing.assert_close(shard.grad, want_grad, **tol, msg=lambda m: f"{where} grad: {m}")

    # gradcheck the vocab-parallel reference in float64 on a one-rank group: numerical gradients need
    # the other ranks' shards held fixed, which only a group of one guarantees.
    solo = [dist.new_group([r]) for r in range(world_size)][rank]
    x64 = logits[:, :v_local].double().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: cross_entropy_ref(x, targets, ignore_index=ignore_index, tp_group=solo), (x64,)), where


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_vocab_parallel_cross_entropy_matches_unsharded_at_tp2(dtype_name):
    # V/tp = 37 is odd and not a power of two; ignore_index 3 lies inside shard 0 to catch confusing
    # an ignored target with a real one.
    run_ranks(2, _check_vocab_parallel, _fresh_seed(), 9, 74, dtype_name, 3)


def test_cross_entropy_ref_matches_torch_on_3d_logits():
    seed = _fresh_seed()
    logits, targets = _problem(seed, 12, 50, torch.float32)
    got = cross_entropy_ref(logits.view(3, 4, 50), targets.view(3, 4))
    want = F.cross_entropy(logits, targets)
    torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"seed={seed}: {m}")


def test_cross_entropy_rejects_mismatched_targets():
    with pytest.raises(ValueError, match="must agree"):
        cross_entropy(torch.zeros(4, 10), torch.zeros(5, dtype=torch.long))
