"""cross_entropy: Triton kernels (interpreted) and reference against F.cross_entropy, gradcheck, and
the vocab-parallel loss built on them (pipetrain.parallel.tensor.cross_entropy) at tp=2 on both the reference
and the Triton path."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipetrain.kernels import cross_entropy
from pipetrain.kernels.cross_entropy import CrossEntropyFn, cross_entropy_ref
from pipetrain.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_ref
from tests.harness import run_ranks
from tests.kernels.common import fresh_seed, tol

# Vocab-parallel splits the max / sum-exp reduction over V into tp partial reductions, so fp32 differs
# from the unsharded one by summation-order round-off only.
TP_FP32 = dict(rtol=1e-5, atol=1e-6)
# (N, V): one row; V not a power of two; V above the kernels' 4096-column block, so they loop.
SHAPES = [(1, 10), (7, 37), (3, 5000), pytest.param((6, 32000), marks=pytest.mark.slow, id="llama-vocab")]


def _problem(seed, n, vocab, dtype, ignore_index=-100):
    """Logits (n, vocab) with a spread of magnitudes, targets hitting every shard plus some ignored."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=g) * 3).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=g)
    if n > 1:
        targets[torch.rand(n, generator=g) < 0.25] = ignore_index
        targets[0] = vocab - 1  # last column of the last shard
        targets[1] = ignore_index
    return logits, targets


def _loss_and_grad(fn, logits, targets, dloss=1.0):
    x = logits.clone().requires_grad_()
    loss = fn(x, targets)
    (loss * dloss).backward()
    return loss, x.grad


@pytest.mark.triton
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cross_entropy_triton_matches_torch(poisoned, shape, dtype):
    seed = fresh_seed()
    logits, targets = _problem(seed, *shape, dtype)
    logits = logits.view(1, *shape)  # (B, T, V) like the model's output
    targets = targets.view(1, shape[0])
    got = _loss_and_grad(lambda x, t: CrossEntropyFn.apply(x, t, -100, 0, None), logits, targets, dloss=0.7)
    want = _loss_and_grad(lambda x, t: F.cross_entropy(x.flatten(0, 1).float(), t.flatten()), logits, targets,
                          dloss=0.7)
    assert got[0].dtype == torch.float32 and got[0].shape == (), f"loss {got[0].dtype} {got[0].shape}"
    torch.testing.assert_close(got[0], want[0], **TP_FP32, msg=lambda m: f"seed={seed} loss: {m}")
    assert got[1].dtype == dtype, got[1].dtype
    torch.testing.assert_close(got[1], want[1], **tol(dtype), msg=lambda m: f"seed={seed} grad: {m}")


@pytest.mark.triton
def test_cross_entropy_triton_honours_custom_ignore_index_and_keeps_logits(poisoned):
    seed = fresh_seed()
    logits, targets = _problem(seed, 9, 21, torch.float32, ignore_index=4)  # 4 is also a real class id
    before = logits.clone()
    got = _loss_and_grad(lambda x, t: CrossEntropyFn.apply(x, t, 4, 0, None), logits, targets)
    want = _loss_and_grad(lambda x, t: F.cross_entropy(x, t, ignore_index=4), logits, targets)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TP_FP32, msg=lambda m: f"seed={seed}: {m}")
    assert torch.equal(logits, before), "the Triton path must not write into the logits"


@pytest.mark.triton
def test_cross_entropy_dispatch_takes_triton_path_when_forced(force_triton):
    loss = cross_entropy(torch.randn(3, 8, requires_grad=True), torch.tensor([1, 2, 3]))
    assert "CrossEntropyFn" in loss.grad_fn.name(), loss.grad_fn.name()


@pytest.mark.triton
def test_cross_entropy_triton_rejects_float_targets_and_float64_logits():
    with pytest.raises(ValueError, match="targets dtype"):
        CrossEntropyFn.apply(torch.randn(2, 5), torch.zeros(2), -100, 0, None)
    with pytest.raises(ValueError, match="dtype"):
        CrossEntropyFn.apply(torch.randn(2, 5, dtype=torch.float64), torch.zeros(2, dtype=torch.long), -100, 0, None)


def _check_vocab_parallel(rank, world_size, seed, n, vocab, ignore_index):
    for dtype in (torch.float32, torch.bfloat16):
        _check_vocab_parallel_dtype(rank, world_size, seed, n, vocab, dtype, ignore_index)
    # gradcheck the vocab-parallel reference in float64 on a one-rank group: numerical gradients need
    # the other ranks' shards held fixed, which only a group of one guarantees. Small (4 x 9): each
    # evaluation makes three gloo collectives.
    solo = [dist.new_group([r]) for r in range(world_size)][rank]
    logits, targets = _problem(seed, 4, 9, torch.float64, ignore_index)
    x64 = logits.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: vocab_parallel_cross_entropy_ref(x, targets, ignore_index, solo), (x64,)), f"seed={seed}"


def _check_vocab_parallel_dtype(rank, world_size, seed, n, vocab, dtype, ignore_index):
    logits, targets = _problem(seed, n, vocab, dtype, ignore_index)
    want, want_grad = _loss_and_grad(lambda x, t: F.cross_entropy(x.float(), t, ignore_index=ignore_index),
                                     logits, targets)
    v_local = vocab // world_size
    cols = slice(rank * v_local, (rank + 1) * v_local)
    for path in ("torch", "triton"):
        os.environ["PIPETRAIN_KERNELS"] = path  # this rank's own process: nothing to restore
        shard = logits[:, cols].clone().requires_grad_()  # (N, V/tp)
        got = vocab_parallel_cross_entropy(shard.view(1, n, v_local), targets.view(1, n), ignore_index,
                                           dist.group.WORLD)
        got.backward()
        where = f"[rank {rank} | tp {rank}] seed={seed} {dtype} {path}"
        expect_fn = "CrossEntropyFn" if path == "triton" else "DivBackward"
        assert expect_fn in got.grad_fn.name(), f"{where}: took {got.grad_fn.name()}"
        assert got.dtype == torch.float32, f"{where}: loss dtype {got.dtype}"
        torch.testing.assert_close(got, want, **TP_FP32, msg=lambda m: f"{where} loss: {m}")
        torch.testing.assert_close(shard.grad, want_grad[:, cols], **tol(dtype),
                                   msg=lambda m: f"{where} grad: {m}")


def test_vocab_parallel_cross_entropy_matches_unsharded_at_tp2():
    # V/tp = 37 is odd and not a power of two; ignore_index 3 lies inside shard 0 to catch confusing
    # an ignored target with a real one. Each rank checks fp32 and bf16 on the torch and the Triton
    # (interpreted) path, in one spawn to keep the default run short.
    run_ranks(2, _check_vocab_parallel, fresh_seed(), 9, 74, 3)


def test_cross_entropy_ref_matches_torch_on_3d_logits():
    seed = fresh_seed()
    logits, targets = _problem(seed, 12, 50, torch.float32)
    got = cross_entropy_ref(logits.view(3, 4, 50), targets.view(3, 4))
    want = F.cross_entropy(logits, targets)
    torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"seed={seed}: {m}")


def test_cross_entropy_ref_passes_gradcheck_in_float64():
    seed = fresh_seed()
    logits, targets = _problem(seed, 5, 7, torch.float64)
    x = logits.requires_grad_()
    assert torch.autograd.gradcheck(lambda a: cross_entropy_ref(a, targets), (x,)), f"seed={seed}"


def test_cross_entropy_rejects_mismatched_targets():
    with pytest.raises(ValueError, match="must agree"):
        cross_entropy(torch.zeros(4, 10), torch.zeros(5, dtype=torch.long))
