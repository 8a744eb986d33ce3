"""swiglu: the Triton kernels (interpreted) against the reference, forward and backward."""
import pytest
import torch

from pipetrain.kernels import swiglu
from pipetrain.kernels.swiglu import SwiGLUFn, swiglu_fwd, swiglu_ref
from tests.kernels.common import fresh_seed, outputs_and_grads, randn, tol

# one element; one row of a width that is not a power of two; more than one 1024-element block
SHAPES = [(1, 1), (1, 45), (3, 7, 53), pytest.param((2, 16, 1376), marks=pytest.mark.slow, id="llama-ffn")]


def _run(fn, a, b, dy):
    return outputs_and_grads(fn, a, b, dy=dy)


@pytest.mark.triton
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_swiglu_triton_matches_reference(poisoned, shape, dtype):
    seed = fresh_seed()
    g, u, dy = (randn(seed + i, *shape, dtype=dtype, scale=3.0) for i in range(3))
    got = _run(SwiGLUFn.apply, g, u, dy)
    want = _run(swiglu_ref, g, u, dy)
    for name, a, b in zip(("y", "dgate", "dup"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{name}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        torch.testing.assert_close(a, b, **tol(dtype), msg=lambda m: f"seed={seed} {name}: {m}")


@pytest.mark.triton
def test_swiglu_triton_accepts_non_contiguous_inputs(poisoned):
    seed = fresh_seed()
    h = randn(seed, 6, 2 * 37)
    g, u = h[:, :37], h[:, 37:]  # the halves of a fused gate/up projection: row stride 74
    torch.testing.assert_close(SwiGLUFn.apply(g, u), swiglu_ref(g, u), **tol(torch.float32))


@pytest.mark.triton
def test_swiglu_dispatch_takes_triton_path_when_forced(force_triton):
    y = swiglu(torch.randn(2, 5, requires_grad=True), torch.randn(2, 5))
    assert "SwiGLUFn" in y.grad_fn.name(), y.grad_fn.name()


@pytest.mark.triton
def test_swiglu_launcher_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="same shape"):
        swiglu_fwd(torch.randn(2, 5), torch.randn(2, 6))
    with pytest.raises(ValueError, match="one dtype"):
        swiglu_fwd(torch.randn(2, 5), torch.randn(2, 5, dtype=torch.bfloat16))


def test_swiglu_ref_passes_gradcheck_in_float64():
    seed = fresh_seed()
    g = randn(seed, 4, 9, dtype=torch.float64).requires_grad_()
    u = randn(seed + 1, 4, 9, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(swiglu_ref, (g, u)), f"seed={seed}"
