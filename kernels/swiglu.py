"""SwiGLU activation: y = silu(gate) * up, silu(g) = g * sigmoid(g). Elementwise, fp32 math.

The backward recomputes silu(gate) from the saved inputs instead of storing it: it saves one (N, F)
activation per layer for a few flops. dgate = dy * up * s * (1 + g * (1 - s)) with s = sigmoid(g),
dup = dy * silu(g). The kernels round silu(g) and dy*up to the I/O dtype where torch's bf16 autograd
of F.silu(gate) * up rounds them, so bf16 results stay within an ulp of the reference.

Shapes: gate, up, y (..., F) flattened to M = numel elements; F is the ffn width (F/tp under tp).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .compile_ops import CompileOp, declare, forward_op
from .dispatch import HAS_TRITON, check_dtype, launches_directly, tl, triton, use_triton, wrap_triton

if HAS_TRITON:
    from .triton_helpers import round_to  # a triton.jit function: defined only with triton

# Elements per program: the Triton vector-add tutorial's 1024 (4 warps x 32 threads x 8 elements);
# memory-bound, so larger blocks gain little. Not tuned here (no GPU).
_BLOCK = 1024


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The spec: CPU path and test oracle."""
    return F.silu(gate) * up


if HAS_TRITON:
    @triton.jit
    def _swiglu_fwd_kernel(g_ptr, u_ptr, y_ptr, M, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: M may pass 2**31
        mask = offs < M
        dt = y_ptr.dtype.element_ty
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        silu = round_to(g * tl.sigmoid(g), dt)
        tl.store(y_ptr + offs, round_to(silu * u, dt).to(dt), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, M, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < M
        dt = dg_ptr.dtype.element_ty
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        silu = round_to(g * s, dt)
        dsilu = round_to(dy * u, dt)
        tl.store(du_ptr + offs, round_to(dy * silu, dt).to(dt), mask=mask)
        tl.store(dg_ptr + offs, round_to(dsilu * s * (1.0 + g * (1.0 - s)), dt).to(dt), mask=mask)


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    check_dtype("swiglu gate", gate)
    if up.dtype != gate.dtype:
        raise ValueError(f"swiglu: up is {up.dtype} but gate is {gate.dtype}; use one dtype")


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Launcher: silu(gate) * up."""
    _check(gate, up)
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty_like(gate)
    M = gate.numel()
    if M:
        wrap_triton(_swiglu_fwd_kernel)[(triton.cdiv(M, _BLOCK),)](gate, up, y, M, BLOCK=_BLOCK, num_warps=4)
    return y


def swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: (dgate, dup) from dy, recomputing silu(gate)."""
    dy, gate, up = dy.contiguous(), gate.contiguous(), up.contiguous()
    dg, du = torch.empty_like(gate), torch.empty_like(up)
    M = gate.numel()
    if M:
        wrap_triton(_swiglu_bwd_kernel)[(triton.cdiv(M, _BLOCK),)](dy, gate, up, dg, du, M, BLOCK=_BLOCK, num_warps=4)
    return dg, du


class SwiGLUFn(torch.autograd.Function):
    @staticmethod
    @launches_directly
    def forward(ctx, gate, up):
        y = swiglu_fwd(gate, up)
        ctx.save_for_backward(gate, up)  # not silu(gate): the backward recomputes it
        return y

    @staticmethod
    @launches_directly
    def backward(ctx, dy):
        return swiglu_bwd(dy, *ctx.saved_tensors)


# pipetrain::swiglu under torch.compile (kernels/compile_ops.py registers it when a run compiles); the
# backward recomputes silu(gate) from the saved inputs
COMPILE_OP = declare(CompileOp(
    name="swiglu", forward=swiglu_fwd, backward=swiglu_bwd,
    fake=lambda gate, up: torch.empty_like(gate),
    backward_fake=lambda dy, gate, up: (torch.empty_like(gate), torch.empty_like(up)),
    num_grads=1, saved_inputs=(0, 1)))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; Triton or reference per dispatch.use_triton."""
    if not use_triton(gate):
        return swiglu_ref(gate, up)
    return forward_op("swiglu")(gate, up) if torch.compiler.is_compiling() else SwiGLUFn.apply(gate, up)
