"""linear_cross_entropy: the chunked paths (torch and Triton-interpreted) against the unfused spec and an
fp64 reference, finite differences, the one-backward rule, autocast, a vocabulary shard, a compiled caller,
and the peak memory of the chunked path."""
import importlib
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pipetrain.kernels import linear_cross_entropy
from pipetrain.kernels.linear_cross_entropy import chunk_rows, linear_cross_entropy_ref
from tests.kernels.common import fresh_seed, randn, tol

LCE = importlib.import_module("pipetrain.kernels.linear_cross_entropy")

# Chunked vs unfused: the same fp32 softmax, but dW is summed chunk by chunk.
CHUNKED_FP32 = dict(rtol=1e-5, atol=1e-6)
# bf16: the chunked path computes its gradients in the forward, before the incoming dloss is known, so
# it rounds the logit gradient to bf16 and scales dh by dloss afterwards, while autograd scales first and
# rounds once; dW is rounded once per chunk instead of once. Entries that come from cancelling sums
# differ by a few ulps of the largest term, not of themselves, hence an absolute floor relative to the
# gradient's largest entry: over 1200 fresh seeds of these CASES the largest difference was 2^-6.1 of it.
CHUNKED_BF16_RTOL, CHUNKED_BF16_FLOOR = 2**-5, 2**-5
# Against fp64, the fused bf16 result's largest error is at most this many times eager bf16's (the
# unfused spec run in bf16), plus one bf16 ulp of the largest entry. Over 400 seeds at (37, 12, 50) the
# worst ratio was 1.07 (loss),
# 1.98 (dh: rounded before it is scaled) and 2.72 (dW: rounded once per chunk, 5 chunks there).
BF16_VS_EAGER = 4.0

# (N, D, V, ignore_index): one token; sizes not powers of two giving several chunks with a short last
# one (chunk_rows(37, 12, 50) = 8 -> 5 chunks, with the floor lowered below); an ignore_index that is
# also a real class id.
CASES = [(1, 8, 11, -100), (37, 12, 50, -100), (20, 6, 33, 5),
         pytest.param((300, 64, 5000, -100), marks=pytest.mark.slow, id="several-vocab-blocks")]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Drop the 256-row chunk floor so that test-sized inputs are split into several chunks."""
    monkeypatch.setattr(LCE, "MIN_CHUNK_ROWS", 1)


def _problem(seed, N, D, V, ignore_index, dtype, ignored_rows=0):
    """Random inputs; the first ignored_rows targets (a whole chunk when >= C) and ~30% of the rest ignored."""
    hidden = randn(seed, N, D, dtype=dtype)
    weight = randn(seed + 1, V, D, dtype=dtype, scale=0.5)
    g = torch.Generator().manual_seed(seed + 2)
    targets = torch.randint(0, V, (N,), generator=g)
    if N > 1:
        keep = targets[-1].item()
        targets[torch.rand(N, generator=g) < 0.3] = ignore_index
        targets[:max(1, ignored_rows)] = ignore_index
        targets[-1] = keep  # one target always trains: with none, the mean loss is 0/0 (nan)
    return hidden, weight, targets


def _run(fn, hidden, weight, targets, ignore_index, dloss):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, w, targets, ignore_index)
    (loss * dloss).backward()
    return loss.detach(), h.grad, w.grad


def _check(seed, case, dtype, ignored_rows=0):
    N, D, V, ignore_index = case
    hidden, weight, targets = _problem(seed, N, D, V, ignore_index, dtype, ignored_rows)
    got = _run(linear_cross_entropy, hidden, weight, targets, ignore_index, dloss=1.5)
    want = _run(linear_cross_entropy_ref, hidden, weight, targets, ignore_index, dloss=1.5)
    assert got[0].dtype == torch.float32, got[0].dtype
    torch.testing.assert_close(got[0], want[0], **CHUNKED_FP32, msg=lambda m: f"seed={seed} loss: {m}")
    for name, a, b in zip(("dhidden", "dweight"), got[1:], want[1:]):
        assert a.dtype == b.dtype, f"{name}: {a.dtype} vs {b.dtype}"
        bf16 = dict(rtol=CHUNKED_BF16_RTOL, atol=CHUNKED_BF16_FLOOR * float(b.abs().max()))
        torch.testing.assert_close(a, b, **tol(dtype, bf16=bf16), msg=lambda m: f"seed={seed} {name}: {m}")
    return hidden, weight, targets, got


def _check_against_fp64(seed, case, dtype, ignored_rows=0):
    """The fused result against the unfused spec in float64: fp32 to fp32 round-off; bf16 within
    BF16_VS_EAGER times the error of eager bf16 (the spec run in bf16)."""
    hidden, weight, targets, got = _check(seed, case, dtype, ignored_rows)
    ignore_index = case[3]
    exact = _run(linear_cross_entropy_ref, hidden.double(), weight.double(), targets, ignore_index, dloss=1.5)
    eager = _run(linear_cross_entropy_ref, hidden, weight, targets, ignore_index, dloss=1.5)
    for name, a, e, x in zip(("loss", "dhidden", "dweight"), got, eager, exact):
        if dtype == torch.float32:
            torch.testing.assert_close(a.double(), x, **CHUNKED_FP32, msg=lambda m: f"seed={seed} {name}: {m}")
        else:
            err, eager_err = float((a.double() - x).abs().max()), float((e.double() - x).abs().max())
            ulp = 2**-8 * float(x.abs().max())  # one bf16 ulp of the largest entry: tiny cases round luckily
            assert err <= BF16_VS_EAGER * eager_err + ulp, f"seed={seed} {name}: error {err:.3g} vs eager {eager_err:.3g}"


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_cross_entropy_torch_chunks_match_unfused_and_fp64(monkeypatch, case, dtype):
    monkeypatch.setenv("PIPETRAIN_KERNELS", "torch")
    _check_against_fp64(fresh_seed(), case, dtype)


@pytest.mark.triton
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_cross_entropy_triton_chunks_match_unfused_and_fp64(poisoned, force_triton, case, dtype):
    _check_against_fp64(fresh_seed(), case, dtype)


@pytest.mark.triton
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_a_chunk_of_only_ignored_targets_adds_nothing(poisoned, monkeypatch, kernels):
    monkeypatch.setenv("PIPETRAIN_KERNELS", kernels)
    assert chunk_rows(37, 12, 50) == 8
    _check_against_fp64(fresh_seed(), (37, 12, 50, -100), torch.float32, ignored_rows=16)  # chunks 0 and 1


def test_linear_cross_entropy_uses_several_chunks_in_the_tests():
    assert chunk_rows(37, 12, 50) == 8 and chunk_rows(1, 8, 11) == 1, "the CASES no longer exercise chunking"


def test_chunks_are_large_for_real_models_and_even(monkeypatch):
    monkeypatch.setattr(LCE, "MIN_CHUNK_ROWS", 256)
    assert chunk_rows(8192, 4096, 128256) == 2048  # llama-3-8B: D/2 rows, 4 chunks (the dW GEMM's inner dim)
    assert chunk_rows(1024, 512, 131072) == 256  # the floor: N*D/V = 4 and D/2 = 256
    assert chunk_rows(8192, 1024, 4096) == 2048  # N*D/V above D/2: chunk logits as large as the hidden states
    assert chunk_rows(100, 4096, 131072) == 100  # never more than N
    assert chunk_rows(3000, 4096, 128256) == 1500  # 2 even chunks, not 2048 + 952


def test_chunks_on_a_gpu_have_4096_rows():
    """On CUDA the dW accumulator's read + write per chunk must stay small beside the chunk's dW GEMM
    (GPU_MIN_CHUNK_ROWS): the llama 1.5B's 32,768 tokens at d 2048 and vocab 128,256 took 32 chunks of 1024."""
    assert chunk_rows(32768, 2048, 128256) == 1024  # the CPU's floor: D/2
    assert chunk_rows(32768, 2048, 128256, "cuda") == 4096  # 8 chunks
    assert chunk_rows(8192, 4096, 128256, "cuda") == 4096  # llama-3-8B: 2 chunks
    assert chunk_rows(32768, 2048, 8192, "cuda") == 8192  # N*D/V above the floor: as on the CPU
    assert chunk_rows(3000, 2048, 128256, "cuda") == 3000  # never more than N


def test_gradients_match_finite_differences_in_float64(monkeypatch):
    # gradcheck-style, by hand: torch.autograd.gradcheck back-propagates one graph twice, which the op
    # forbids (see the next test). Central differences of the float64 loss at every input element, on
    # the torch path (the Triton kernels take fp32 and bf16 only; they are checked against fp64 above).
    monkeypatch.setenv("PIPETRAIN_KERNELS", "torch")
    seed = fresh_seed()
    hidden, weight, targets = _problem(seed, 11, 4, 7, -100, torch.float64)
    _, dh, dw = _run(linear_cross_entropy, hidden, weight, targets, -100, dloss=1.0)
    eps = 1e-6
    for x, grad in ((hidden, dh), (weight, dw)):
        numeric = torch.empty_like(x)
        for i in range(x.numel()):
            orig = x.view(-1)[i].item()
            x.view(-1)[i] = orig + eps
            up = linear_cross_entropy(hidden, weight, targets).item()
            x.view(-1)[i] = orig - eps
            down = linear_cross_entropy(hidden, weight, targets).item()
            x.view(-1)[i] = orig
            numeric.view(-1)[i] = (up - down) / (2 * eps)
        torch.testing.assert_close(grad, numeric, rtol=1e-5, atol=1e-7, msg=lambda m: f"seed={seed}: {m}")


def test_a_second_backward_through_one_forward_raises():
    hidden, weight, targets = _problem(fresh_seed(), 9, 5, 13, -100, torch.float32)
    h = hidden.requires_grad_()
    loss = linear_cross_entropy(h, weight, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_backward_scales_the_gradients_by_the_incoming_one():
    seed = fresh_seed()
    hidden, weight, targets = _problem(seed, 9, 5, 13, -100, torch.float32)
    for dloss in (1.0, 0.25):  # 1.0 skips the multiply
        got = _run(linear_cross_entropy, hidden, weight, targets, -100, dloss)
        want = _run(linear_cross_entropy_ref, hidden, weight, targets, -100, dloss)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **CHUNKED_FP32, msg=lambda m: f"seed={seed} dloss={dloss}: {m}")


class PeakBytes(TorchDispatchMode):
    """The most bytes of CPU tensor storage alive at once among tensors created inside the mode (the
    torch allocator's peak for this code, with no timing involved)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen = set()

    def _freed(self, key, nbytes):
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                if storage._cdata not in self._seen:
                    self._seen.add(storage._cdata)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, storage._cdata, storage.nbytes())
        return out


def _peak_bytes(fn, hidden, weight, targets) -> int:
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with PeakBytes() as mode:
        fn(h, w, targets).backward()
    return mode.peak


def test_peak_memory_stays_far_below_the_logits(monkeypatch):
    monkeypatch.setenv("PIPETRAIN_KERNELS", "torch")
    monkeypatch.setattr(LCE, "MIN_CHUNK_ROWS", 64)
    N, D, V = 1024, 16, 4096
    hidden, weight, targets = _problem(fresh_seed(), N, D, V, -100, torch.float32)
    assert chunk_rows(N, D, V) == 64  # 16 chunks
    logits_bytes = N * V * 4
    fused = _peak_bytes(linear_cross_entropy, hidden, weight, targets)
    eager = _peak_bytes(linear_cross_entropy_ref, hidden, weight, targets)
    assert eager >= 2 * logits_bytes, (eager, logits_bytes)  # the meter sees eager's logits and softmax
    # a (C, V) chunk (1/16 of the logits), its softmax temporaries, dW (V, D) and dh (N, D) with .grad
    assert fused < 0.2 * logits_bytes, f"fused peak {fused} B vs (N, V) logits {logits_bytes} B, eager {eager} B"


def test_linear_cross_entropy_without_grad_returns_the_loss_only():
    seed = fresh_seed()
    hidden, weight, targets = _problem(seed, 9, 5, 13, -100, torch.float32)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, targets)
    torch.testing.assert_close(loss, linear_cross_entropy_ref(hidden, weight, targets), **CHUNKED_FP32)
    assert loss.grad_fn is None


def test_autocast_runs_the_op_in_bf16_and_returns_fp32_master_gradients():
    seed = fresh_seed()
    hidden, weight, targets = _problem(seed, 37, 12, 50, -100, torch.float32)
    results = []
    for fn in (linear_cross_entropy, linear_cross_entropy_ref):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn(h, w, targets)
        loss.backward()
        assert h.grad.dtype == w.grad.dtype == torch.float32
        results.append((loss.detach(), h.grad, w.grad))
    # the fused op ran in bf16, as autocast runs the head's matmul: the same loss as on bf16 inputs
    assert torch.equal(results[0][0], linear_cross_entropy(hidden.bfloat16(), weight.bfloat16(), targets))
    for a, b in zip(*results):
        torch.testing.assert_close(a.float(), b.float(), rtol=CHUNKED_BF16_RTOL,
                                   atol=CHUNKED_BF16_FLOOR * float(b.abs().max()), msg=lambda m: f"seed={seed}: {m}")


def test_linear_cross_entropy_rejects_mismatched_shapes_and_dtypes():
    h, w, t = torch.randn(4, 6), torch.randn(10, 6), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="must be \\(V, D\\)"):
        linear_cross_entropy(h, torch.randn(10, 5), t)
    with pytest.raises(ValueError, match="must agree"):
        linear_cross_entropy(h, w, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="one dtype"):
        linear_cross_entropy(h, w.bfloat16(), t)


def test_the_op_runs_inside_a_compiled_function_as_a_graph_break(monkeypatch):
    monkeypatch.setenv("PIPETRAIN_KERNELS", "torch")
    seed = fresh_seed()
    hidden, weight, targets = _problem(seed, 37, 12, 50, -100, torch.float32)
    compiled = torch.compile(lambda h, w, t: linear_cross_entropy(h, w, t) * 2.0, backend="eager", fullgraph=False)
    got = _run(lambda h, w, t, ignore_index: compiled(h, w, t) / 2.0, hidden, weight, targets, -100, dloss=1.0)
    want = _run(linear_cross_entropy, hidden, weight, targets, -100, dloss=1.0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **CHUNKED_FP32, msg=lambda m: f"seed={seed}: {m}")


@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_a_vocab_shard_with_combined_row_numbers_gives_the_full_loss_and_its_part_of_the_gradients(
        poisoned, monkeypatch, kernels):
    # In one process: combine returns what the all-reduces over every shard would (the full vocabulary's
    # row numbers, chunk by chunk); the multi-process version is tests/dist/test_fused_loss.py.
    monkeypatch.setenv("PIPETRAIN_KERNELS", kernels)
    seed = fresh_seed()
    hidden, weight, targets = _problem(seed, 37, 12, 50, -100, torch.float32)
    lo, hi = 20, 50  # this shard's vocabulary rows
    full = hidden @ weight.t()  # (N, V)
    seen = [0]

    def combine(row_max, sum_exp, target_logit):
        rows = slice(seen[0], seen[0] + row_max.shape[0])
        seen[0] += row_max.shape[0]
        x, t = full[rows], targets[rows]
        m = x.amax(-1)
        picked = x.gather(1, t.clamp(min=0)[:, None]).squeeze(1)
        return m, (x - m[:, None]).exp().sum(-1), torch.where(t != -100, picked, 0.0)

    h, w = hidden.clone().requires_grad_(), weight[lo:hi].clone().requires_grad_()
    loss = linear_cross_entropy(h, w, targets, vocab_start=lo, combine=combine)
    (loss * 1.5).backward()
    assert seen[0] == 37 and chunk_rows(37, 12, 30) < 37  # every row combined, over several chunks
    valid = targets != -100
    g = torch.softmax(full, -1) - torch.nn.functional.one_hot(targets.clamp(min=0), 50)
    g = g * (1.5 * valid / valid.sum())[:, None]  # the full logit gradient (N, V)
    want = _run(linear_cross_entropy_ref, hidden, weight, targets, -100, dloss=1.5)
    torch.testing.assert_close(loss.detach(), want[0], **CHUNKED_FP32, msg=lambda m: f"seed={seed} loss: {m}")
    torch.testing.assert_close(w.grad, want[2][lo:hi], **CHUNKED_FP32, msg=lambda m: f"seed={seed} dW rows: {m}")
    torch.testing.assert_close(h.grad, g[:, lo:hi] @ weight[lo:hi], **CHUNKED_FP32,
                               msg=lambda m: f"seed={seed} dh part: {m}")
