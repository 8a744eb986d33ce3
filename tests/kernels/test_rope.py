"""rope: the Triton kernels (interpreted) against transformers' apply_rotary_pos_emb, bit for bit."""
import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from pipetrain.kernels import rope
from pipetrain.kernels.rope import RoPEFn, rope_fwd, rope_ref
from pipetrain.models.decoder import rope_tables
from tests.kernels.common import fresh_seed, randn

# (B, T, Hq, Hkv, K): one token; heads not powers of two with GQA; K/2 odd.
SHAPES = [(1, 1, 2, 1, 8), (2, 5, 6, 2, 12), (1, 7, 3, 3, 10)]
# llama-8B-like heads (32 q, 8 kv, K=128), a few tokens: slow under the interpreter
LARGE = pytest.param((1, 6, 32, 8, 128), marks=pytest.mark.slow, id="llama-heads")


def _hf(q, k, cos, sin):
    """transformers' function on our (B, T, H, K) layout: it wants (B, H, T, K) and (B, T, K) tables."""
    qh, kh = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos[None], sin[None], unsqueeze_dim=1)
    return qh.transpose(1, 2), kh.transpose(1, 2)


def _run(fn, q, k, cos, sin, dq, dk):
    q, k = q.clone().requires_grad_(), k.clone().requires_grad_()
    qo, ko = fn(q, k, cos, sin)
    torch.autograd.backward((qo, ko), (dq, dk))
    return qo, ko, q.grad, k.grad


@pytest.mark.triton
@pytest.mark.parametrize("shape", [*SHAPES, LARGE], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_triton_equals_hf_apply_rotary_pos_emb_exactly(poisoned, shape, dtype):
    B, T, Hq, Hkv, K = shape
    seed = fresh_seed()
    q, dq = randn(seed, B, T, Hq, K, dtype=dtype), randn(seed + 1, B, T, Hq, K, dtype=dtype)
    k, dk = randn(seed + 2, B, T, Hkv, K, dtype=dtype), randn(seed + 3, B, T, Hkv, K, dtype=dtype)
    cos, sin = rope_tables(T, K, 10000.0, "cpu", dtype)
    got = _run(RoPEFn.apply, q, k, cos, sin, dq, dk)
    want = _run(_hf, q, k, cos, sin, dq, dk)
    for name, g, w in zip(("q_rot", "k_rot", "dq", "dk"), got, want):
        assert g.dtype == w.dtype, f"{name}: {g.dtype} vs {w.dtype}"
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=lambda m: f"seed={seed} {name}: {m}")


def test_rope_ref_equals_hf_apply_rotary_pos_emb():
    seed = fresh_seed()
    q, k = randn(seed, 2, 6, 4, 16), randn(seed + 1, 2, 6, 2, 16)
    cos, sin = rope_tables(6, 16, 500.0, "cpu", torch.float32)
    for g, w in zip(rope_ref(q, k, cos, sin), _hf(q, k, cos, sin)):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=lambda m: f"seed={seed}: {m}")


@pytest.mark.triton
def test_rope_triton_uses_both_table_halves_when_they_differ(poisoned):
    # The kernels must not assume Hugging Face's duplicated halves: general tables still match the spec.
    seed = fresh_seed()
    q, k = randn(seed, 1, 3, 2, 6), randn(seed + 1, 1, 3, 1, 6)
    cos, sin = randn(seed + 2, 3, 6), randn(seed + 3, 3, 6)
    dq, dk = randn(seed + 4, 1, 3, 2, 6), randn(seed + 5, 1, 3, 1, 6)
    for g, w in zip(_run(RoPEFn.apply, q, k, cos, sin, dq, dk), _run(rope_ref, q, k, cos, sin, dq, dk)):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=lambda m: f"seed={seed}: {m}")


@pytest.mark.triton
def test_rope_triton_accepts_non_contiguous_q(poisoned):
    seed = fresh_seed()
    q = randn(seed, 2, 4, 3, 8).transpose(1, 2)  # (B, T=3, H=4, K) with T and H strides swapped
    k = randn(seed + 1, 2, 3, 1, 8)
    cos, sin = rope_tables(3, 8, 10000.0, "cpu", torch.float32)
    for g, w in zip(RoPEFn.apply(q, k, cos, sin), rope_ref(q, k, cos, sin)):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=lambda m: f"seed={seed}: {m}")


@pytest.mark.triton
def test_rope_dispatch_takes_triton_path_when_forced(force_triton):
    q = torch.randn(1, 2, 2, 4, requires_grad=True)
    cos, sin = rope_tables(2, 4, 10000.0, "cpu", torch.float32)
    qo, _ = rope(q, torch.randn(1, 2, 1, 4), cos, sin)
    assert "RoPEFn" in qo.grad_fn.name(), qo.grad_fn.name()


@pytest.mark.triton
def test_rope_launcher_rejects_bad_shapes_and_mixed_dtypes():
    cos, sin = rope_tables(4, 8, 10000.0, "cpu", torch.float32)
    with pytest.raises(ValueError, match="must be \\(T, K\\)"):
        rope_fwd(torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8), cos, sin)
    with pytest.raises(ValueError, match="must be even"):
        rope_fwd(torch.randn(1, 4, 2, 7), torch.randn(1, 4, 2, 7), cos[:, :7], sin[:, :7])
    with pytest.raises(ValueError, match="cast the tables"):
        rope_fwd(torch.randn(1, 4, 2, 8, dtype=torch.bfloat16), torch.randn(1, 4, 2, 8, dtype=torch.bfloat16),
                 cos, sin)


def test_rope_ref_passes_gradcheck_in_float64():
    seed = fresh_seed()
    q = randn(seed, 1, 3, 2, 6, dtype=torch.float64).requires_grad_()
    k = randn(seed + 1, 1, 3, 1, 6, dtype=torch.float64).requires_grad_()
    cos, sin = rope_tables(3, 6, 10000.0, "cpu", torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: rope_ref(a, b, cos, sin), (q, k)), f"seed={seed}"
