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
