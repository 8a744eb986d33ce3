"""linear_cross_entropy: the chunked paths (torch and Triton-interpreted) against the unfused spec."""
import importlib

import pytest
import torch

from pipetrain.kernels import linear_cross_entropy
from pipetrain.kernels.linear_cross_entropy import chunk_rows, linear_cross_entropy_ref
from tests.kernels.common import fresh_seed, randn, tol

# Chunked vs unfused: the same fp32 softmax, but dW is summed chunk by chunk.
CHUNKED_FP32 = dict(rtol=1e-5, atol=1e-6)
# bf16: the chunked path computes its gradients in the forward, before the incoming dloss is known, so
# it rounds the logit gradient to bf16 and scales dh by dloss afterwards, while autograd scales first and
# rounds once; dW is summed in fp32 over chunks instead of in one bf16 matmul. Entries that come from
# cancelling sums differ by a few ulps of the largest term, not of themselves, hence an absolute floor
# relative to the gradient's largest entry: over 1200 fresh seeds of these CASES the largest difference
# was 2^-6.1 of it (a fixed floor of 2^-9 failed one seed in a few hundred).
CHUNKED_BF16_RTOL, CHUNKED_BF16_FLOOR = 2**-5, 2**-5

# (N, D, V, ignore_index): one token; sizes not powers of two giving several chunks with a short last
# one (chunk_rows(37, 12, 50) = 9 -> 5 chunks, with the floor lowered below); an ignore_index that is
# also a real class id.
CASES = [(1, 8, 11, -100), (37, 12, 50, -100), (20, 6, 33, 5),
         pytest.param((300, 64, 5000, -100), marks=pytest.mark.slow, id="several-vocab-blocks")]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Drop the 256-row chunk floor so that test-sized inputs are split into several chunks."""
    monkeypatch.setattr(importlib.import_module("pipetrain.kernels.linear_cross_entropy"), "MIN_CHUNK_ROWS", 1)


def _problem(seed, N, D, V, ignore_index, dtype):
    hidden = randn(seed, N, D, dtype=dtype)
    weight = randn(seed + 1, V, D, dtype=dtype, scale=0.5)
    g = torch.Generator().manual_seed(seed + 2)
    targets = torch.randint(0, V, (N,), generator=g)
    if N > 1:
        keep = targets[-1].item()
        targets[torch.rand(N, generator=g) < 0.3] = ignore_index
        targets[0] = ignore_index
        targets[-1] = keep  # one target always trains: with none, the mean loss is 0/0 (nan) and gradcheck fails
    return hidden, weight, targets


def _run(fn, hidden, weight, targets, ignore_index, dloss):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, w, targets, ignore_index)
    (loss * dloss).backward()
    return loss, h.grad, w.grad


def _check(seed, case, dtype):
    N, D, V, ignore_index = case
    hidden, weight, targets = _problem(seed, N, D, V, ignore_index, dtype)
    got = _run(linear_cross_entropy, hidden, weight, targets, ignore_index, dloss=1.5)
    want = _run(linear_cross_entropy_ref, hidden, weight, targets, ignore_index, dloss=1.5)
    assert got[0].dtype == torch.float32, got[0].dtype
    torch.testing.assert_close(got[0], want[0], **CHUNKED_FP32, msg=lambda m: f"seed={seed} loss: {m}")
    for name, a, b in zip(("dhidden", "dweight"), got[1:], want[1:]):
        assert a.dtype == b.dtype, f"{name}: {a.dtype} vs {b.dtype}"
        bf16 = dict(rtol=CHUNKED_BF16_RTOL, atol=CHUNKED_BF16_FLOOR * float(b.abs().max()))
        torch.testing.assert_close(a, b, **tol(dtype, bf16=bf16), msg=lambda m: f"seed={seed} {name}: {m}")


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_cross_entropy_torch_chunks_match_unfused(monkeypatch, case, dtype):
    monkeypatch.setenv("PIPETRAIN_KERNELS", "torch")
    _check(fresh_seed(), case, dtype)


@pytest.mark.triton
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_cross_entropy_triton_chunks_match_unfused(poisoned, force_triton, case, dtype):
    _check(fresh_seed(), case, dtype)


def test_linear_cross_entropy_uses_several_chunks_in_the_tests():
    assert chunk_rows(37, 12, 50) == 9 and chunk_rows(1, 8, 11) == 1, "the CASES no longer exercise chunking"


def test_linear_cross_entropy_chunks_have_at_least_the_floor_of_rows(monkeypatch):
    monkeypatch.setattr(importlib.import_module("pipetrain.kernels.linear_cross_entropy"), "MIN_CHUNK_ROWS", 256)
    assert chunk_rows(1024, 512, 131072) == 256  # N*D/V = 4 rows would make dW updates dominate
    assert chunk_rows(8192, 4096, 32768) == 1024  # N*D/V above the floor
    assert chunk_rows(100, 4096, 131072) == 100  # never more than N


def test_linear_cross_entropy_chunked_path_passes_gradcheck_in_float64(monkeypatch):
    # The chunked Function computes its gradients in the forward pass; gradcheck compares them with
    # finite differences of the loss it returns.
    monkeypatch.setenv("PIPETRAIN_KERNELS", "torch")
    seed = fresh_seed()
    hidden, weight, targets = _problem(seed, 11, 4, 7, -100, torch.float64)
    assert torch.autograd.gradcheck(lambda h, w: linear_cross_entropy(h, w, targets),
                                    (hidden.requires_grad_(), weight.requires_grad_())), f"seed={seed}"


def test_linear_cross_entropy_ref_passes_gradcheck_in_float64():
    seed = fresh_seed()
    hidden, weight, targets = _problem(seed, 5, 3, 6, -100, torch.float64)
    assert torch.autograd.gradcheck(lambda h, w: linear_cross_entropy_ref(h, w, targets),
                                    (hidden.requires_grad_(), weight.requires_grad_())), f"seed={seed}"


def test_linear_cross_entropy_without_grad_returns_the_loss_only():
    seed = fresh_seed()
    hidden, weight, targets = _problem(seed, 9, 5, 13, -100, torch.float32)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, targets)
    torch.testing.assert_close(loss, linear_cross_entropy_ref(hidden, weight, targets), **CHUNKED_FP32)
    assert loss.grad_fn is None


def test_linear_cross_entropy_rejects_mismatched_shapes_and_dtypes():
    h, w, t = torch.randn(4, 6), torch.randn(10, 6), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="must be \\(V, D\\)"):
        linear_cross_entropy(h, torch.randn(10, 5), t)
    with pytest.raises(ValueError, match="must agree"):
        linear_cross_entropy(h, w, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="one dtype"):
        linear_cross_entropy(h, w.bfloat16(), t)
