"""Rotary position embedding, Hugging Face "rotate_half" convention, q and k in one launch.

y = x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1) for the halves x1, x2 of the
head dim. Written per half: y1 = x1*c1 - x2*s1, y2 = x2*c2 + x1*s2, and the backward is the transposed
rotation dx1 = dy1*c1 + dy2*s2, dx2 = dy2*c2 - dy1*s1 (no gradient for the cos/sin tables).
The kernels round to the I/O dtype after every multiply and add, exactly where torch's bf16 arithmetic
rounds, so they match transformers' apply_rotary_pos_emb bit for bit in bf16 as well as fp32.

Shapes: q (B, T, Hq, K), k (B, T, Hkv, K), cos/sin (T, K) with the two halves duplicated as Hugging
Face's rotary embedding lays them out (the kernels do not rely on the duplication).
"""
from __future__ import annotations

import torch

from .compile_ops import CompileOp, declare, forward_op
from .dispatch import HAS_TRITON, check_dtype, launches_directly, tl, triton, use_triton, wrap_triton
from .triton_helpers import MAX_FUSED_BYTES

if HAS_TRITON:
    from .triton_helpers import round_to  # a triton.jit function: defined only with triton


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The spec (CPU path and test oracle): transformers' apply_rotary_pos_emb on (B, T, H, K) tensors."""
    cos = cos[:, None, :]  # (T, 1, K) broadcasts over heads
    sin = sin[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


if HAS_TRITON:
    @triton.jit
    def _rotate_tile(x_ptr, y_ptr, base, H, K, c1, c2, a1, a2, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
        # y1 = x1*c1 - x2*a1, y2 = x2*c2 + x1*a2 for every head of one token; rounding to the I/O dtype
        # after each op reproduces torch's arithmetic in that dtype (a no-op for fp32).
        dt = y_ptr.dtype.element_ty
        half = K // 2
        heads = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_HALF)[None, :]
        mask = (heads < H) & (d < half)
        offs = base + heads * K + d
        x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + offs + half, mask=mask, other=0.0).to(tl.float32)
        y1 = round_to(round_to(x1 * c1, dt) - round_to(x2 * a1, dt), dt)
        y2 = round_to(round_to(x2 * c2, dt) + round_to(x1 * a2, dt), dt)
        tl.store(y_ptr + offs, y1.to(dt), mask=mask)
        tl.store(y_ptr + offs + half, y2.to(dt), mask=mask)

    @triton.jit
    def _load_tables(cos_ptr, sin_ptr, t, K, BLOCK_HALF: tl.constexpr):
        half = K // 2
        d = tl.arange(0, BLOCK_HALF)[None, :]
        mask = d < half
        row = cos_ptr + t * K + d
        c1 = tl.load(row, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(row + half, mask=mask, other=0.0).to(tl.float32)
        row = sin_ptr + t * K + d
        s1 = tl.load(row, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(row + half, mask=mask, other=0.0).to(tl.float32)
        return c1, c2, s1, s2

    @triton.jit
    def _rope_fwd_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, T, Hq, Hkv, K,
                         BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr):
        tok = tl.program_id(0)  # one program per (b, t): all q and k heads of that token
        c1, c2, s1, s2 = _load_tables(cos_ptr, sin_ptr, tok % T, K, BLOCK_HALF)
        tok64 = tok.to(tl.int64)  # int64 offsets: B * T * H * K may pass 2**31
        _rotate_tile(q_ptr, qo_ptr, tok64 * Hq * K, Hq, K, c1, c2, s1, s2, BLOCK_HQ, BLOCK_HALF)
        _rotate_tile(k_ptr, ko_ptr, tok64 * Hkv * K, Hkv, K, c1, c2, s1, s2, BLOCK_HKV, BLOCK_HALF)

    @triton.jit
    def _rope_bwd_kernel(dq_ptr, dk_ptr, cos_ptr, sin_ptr, dqo_ptr, dko_ptr, T, Hq, Hkv, K,
                         BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr):
        # The transposed rotation: dx1 = dy1*c1 - dy2*(-s2), dx2 = dy2*c2 + dy1*(-s1).
        tok = tl.program_id(0)
        c1, c2, s1, s2 = _load_tables(cos_ptr, sin_ptr, tok % T, K, BLOCK_HALF)
        tok64 = tok.to(tl.int64)
        _rotate_tile(dq_ptr, dqo_ptr, tok64 * Hq * K, Hq, K, c1, c2, -s2, -s1, BLOCK_HQ, BLOCK_HALF)
        _rotate_tile(dk_ptr, dko_ptr, tok64 * Hkv * K, Hkv, K, c1, c2, -s2, -s1, BLOCK_HKV, BLOCK_HALF)




def _launch(kernel, q, k, cos, sin):
    """Shared launcher of both directions: checks, makes contiguous, launches one program per token."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"rope: q {tuple(q.shape)} and k {tuple(k.shape)} must be (B, T, H, K)")
    B, T, Hq, K = q.shape
    if k.shape[:2] != (B, T) or k.shape[3] != K:
        raise ValueError(f"rope: k {tuple(k.shape)} must share B, T and K with q {tuple(q.shape)}")
    if K % 2:
        raise ValueError(f"rope: head dim K={K} must be even (the rotation pairs its two halves)")
    if cos.shape != (T, K) or sin.shape != (T, K):
        raise ValueError(f"rope: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be (T, K) = ({T}, {K})")
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_dtype(f"rope {name}", t)
        if t.dtype != q.dtype:
            raise ValueError(f"rope: {name} is {t.dtype} but q is {q.dtype}; cast the tables to q's dtype")
    Hkv = k.shape[2]
    block_half = triton.next_power_of_2(K // 2)
    block_hq, block_hkv = triton.next_power_of_2(Hq), triton.next_power_of_2(Hkv)
    if 2 * block_hq * block_half * q.element_size() > MAX_FUSED_BYTES:
        raise ValueError(f"rope: Hq*K={Hq * K} per token exceeds one program's {MAX_FUSED_BYTES} bytes; "
                         "use PIPETRAIN_KERNELS=torch")
    q, k, cos, sin = (t.contiguous() for t in (q, k, cos, sin))
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    if B * T:
        # num_warps 4: Triton's default; the tile is at most 64 KB and not tuned (no GPU measured here).
        wrap_triton(kernel)[(B * T,)](q, k, cos, sin, qo, ko, T, Hq, Hkv, K, BLOCK_HQ=block_hq,
                                      BLOCK_HKV=block_hkv, BLOCK_HALF=block_half, num_warps=4)
    return qo, ko


def rope_fwd(q: torch.Tensor, k: torch.Tensor,
             cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: rotated (q, k)."""
    return _launch(_rope_fwd_kernel, q, k, cos, sin)


def rope_bwd(dq: torch.Tensor, dk: torch.Tensor,
             cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: gradients of q and k from those of the rotated outputs."""
    return _launch(_rope_bwd_kernel, dq, dk, cos, sin)


class RoPEFn(torch.autograd.Function):
    @staticmethod
    @launches_directly
    def forward(ctx, q, k, cos, sin):
        if cos.requires_grad or sin.requires_grad:
            raise ValueError("rope: the Triton path has no gradient for cos/sin; pass tables without grad")
        ctx.save_for_backward(cos, sin)
        return rope_fwd(q, k, cos, sin)

    @staticmethod
    @launches_directly
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = rope_bwd(dq, dk, cos, sin)
        return dq, dk, None, None


# pipetrain::rope under torch.compile (kernels/compile_ops.py registers it when a run compiles); no
# gradient for the position tables, as RoPEFn
COMPILE_OP = declare(CompileOp(
    name="rope", forward=rope_fwd, backward=rope_bwd,
    fake=lambda q, k, cos, sin: (torch.empty_like(q), torch.empty_like(k)),
    backward_fake=lambda dq, dk, cos, sin: (torch.empty_like(dq), torch.empty_like(dk)),
    num_grads=2, saved_inputs=(2, 3)))


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q and k by the position tables; returns (q_rot, k_rot). Triton or reference per use_triton."""
    if not use_triton(q):
        return rope_ref(q, k, cos, sin)
    return forward_op("rope")(q, k, cos, sin) if torch.compiler.is_compiling() else RoPEFn.apply(q, k, cos, sin)
