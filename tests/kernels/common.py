"""Shared pieces of the kernel tests: fresh seeds, poisoned allocations, named tolerances."""
from __future__ import annotations

import random

import pytest
import torch

# Named tolerances, each with the reason it is needed.
# fp32: the Triton kernels reduce in a different order than torch (tree vs. sequential sums).
FP32 = dict(rtol=1e-5, atol=1e-6)
# bf16 outputs: both paths compute in fp32 and round once, so a value whose fp32 results straddle a
# rounding boundary differs by one bf16 ulp (2**-8 relative, 2**-7 to be safe near powers of two).
BF16 = dict(rtol=2**-7, atol=1e-5)
# bf16 where the reference rounds after every op (rope, swiglu run in bf16 arithmetic, as Hugging
# Face's do) while the kernel rounds once: a few ulps apart.
BF16_OPS = dict(rtol=2**-5, atol=2**-7)


def _squeeze_interpreter_indices() -> None:
    """(At import, so that the gloo workers of a kernel test, which import this module, get it too.)
    Triton 3.6's interpreter (the lent GPUs' Triton) makes a kernel scalar an index with int() of its
    (1,)-shaped numpy array, which numpy 2.4 refuses ("only 0-dimensional arrays can be converted to Python
    scalars"): every kernel loop over a runtime bound (range(pid, N, num_programs), range(0, V, BLOCK))
    failed there. Later Tritons squeeze the array first; this wraps the interpreter's patch of tl.tensor to
    do the same, where numpy refuses. Test infrastructure only: compiled kernels never take this path."""
    import numpy as np
    try:
        from triton.runtime import interpreter
    except ImportError:  # no triton: the kernel tests take the torch references
        return
    try:
        int(np.zeros(1))
        return  # this numpy converts (1,) arrays: nothing to fix
    except TypeError:
        pass
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "squeezes", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))
    patched.squeezes = True
    interpreter._patch_lang_tensor = patched


_squeeze_interpreter_indices()


def fresh_seed() -> int:
    """A new seed every run (quoted in failure messages so a failure can be replayed)."""
    return random.SystemRandom().randrange(2**31)


def randn(seed: int, *shape: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty / torch.empty_like return NaN-filled floats (-7 for ints) so unwritten elements show."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan") if t.is_floating_point() else -7)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(real_empty_like(*a, **k)))


@pytest.fixture
def force_triton(monkeypatch):
    """Route the public ops to their Triton path (interpreted on CPU; see conftest.py)."""
    monkeypatch.setenv("PIPETRAIN_KERNELS", "triton")


def tol(dtype: torch.dtype, bf16=BF16) -> dict:
    return FP32 if dtype == torch.float32 else bf16


def outputs_and_grads(fn, *inputs: torch.Tensor, dy: torch.Tensor):
    """(fn(*inputs), grad of each input) for upstream gradient dy, on fresh leaf copies of inputs."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    y.backward(dy)
    return (y, *(t.grad for t in leaves))
