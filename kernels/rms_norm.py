"""RMSNorm over the last dim: y = x * rsqrt(mean(x^2) + eps) * w. fp32 math, output in out_dtype (x.dtype
unless given: the model asks for autocast's dtype, so that its linears need no cast of their own).

Shapes: x (..., D) flattened to (N, D), w (D,), rstd (N,) fp32, dw partials (P, D) fp32 with P programs.
The forward saves rstd so the backward does not recompute the reduction. The weight gradient is a sum
over rows; instead of atomics (non-deterministic order), each of P programs sums a strided set of
rows into its own fp32 row of a (P, D) buffer, and torch sums the P rows afterwards.
"""
from __future__ import annotations

import torch

from .compile_ops import CompileOp, declare, forward_op
from .dispatch import HAS_TRITON, check_dtype, launches_directly, tl, triton, use_triton, wrap_triton
from .triton_helpers import MAX_FUSED_BYTES, num_warps_for

if HAS_TRITON:
    from .triton_helpers import round_to  # a triton.jit function: defined only with triton

# A row must fit in one program: D <= 16384 in fp32 and D <= 32768 in bf16 (MAX_FUSED_BYTES).
# Programs for the dw partial sums on CUDA: one per SM keeps every SM busy and P small. The
# interpreter runs programs one after another, so on CPU the count only sets the partial-sum width.
_CPU_PROGRAMS = 4


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The spec: CPU path and test oracle (float64 stays float64 for gradcheck)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    w = weight.to(xf.dtype)
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * w).to(out_dtype or x.dtype)


if HAS_TRITON:
    @triton.jit
    def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, D, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # one program per row; rows are contiguous, stride D
        base = row.to(tl.int64) * D  # int64: N * D may pass 2**31 elements
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        # eps: Triton's launcher types a Python float fp32, but inductor's fp64 (under train.compile): in fp64
        # the math after it would run in fp64 and round_to could not round it (it bitcasts 32-bit words)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + tl.cast(eps, tl.float32))
        tl.store(rstd_ptr + row, rstd)
        dt = y_ptr.dtype.element_ty
        tl.store(y_ptr + base + cols, round_to(x * rstd * w, dt).to(dt), mask=mask)

    @triton.jit
    def _rms_norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, N, D,
                             BLOCK: tl.constexpr):
        # dx = rstd * (dy*w - xhat * mean(dy*w*xhat)), xhat = x*rstd; dw = sum_rows dy*xhat.
        pid = tl.program_id(0)
        num_programs = tl.num_programs(0)
        dt = dx_ptr.dtype.element_ty
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK,), dtype=tl.float32)
        for row in range(pid, N, num_programs):
            base = tl.cast(row, tl.int64) * D
            x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            xhat = x * rstd
            dyw = dy * w
            c = tl.sum(dyw * xhat, axis=0) / D
            tl.store(dx_ptr + base + cols, round_to(rstd * (dyw - xhat * c), dt).to(dt), mask=mask)
            dw += dy * xhat
        tl.store(dw_part_ptr + pid * D + cols, dw, mask=mask)


def _block(where: str, x: torch.Tensor) -> int:
    D = x.shape[-1]
    block = triton.next_power_of_2(D)
    if block * x.element_size() > MAX_FUSED_BYTES:
        raise ValueError(f"{where}: D={D} does not fit one program ({MAX_FUSED_BYTES} bytes per row in "
                         f"{x.dtype}); use PIPETRAIN_KERNELS=torch for such rows")
    return block


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: x (..., D), weight (D,) -> y shaped like x in out_dtype, rstd (N,) fp32."""
    check_dtype("rms_norm", x)
    check_dtype("rms_norm weight", weight)
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} must be ({D},) to match x's last dim")
    if D == 0:
        raise ValueError(f"rms_norm: x {tuple(x.shape)} has an empty last dim; there is nothing to normalise")
    block = _block("rms_norm", x)
    x2 = x.contiguous().view(-1, D)  # (N, D)
    y = torch.empty_like(x2, dtype=out_dtype)
    check_dtype("rms_norm output", y)
    rstd = torch.empty(x2.shape[0], device=x.device, dtype=torch.float32)
    if x2.shape[0]:  # zero rows (an empty micro-batch) launch nothing
        wrap_triton(_rms_norm_fwd_kernel)[(x2.shape[0],)](x2, weight.contiguous(), y, rstd, D, eps, BLOCK=block,
                                             num_warps=num_warps_for(block))
    return y.view(x.shape), rstd


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: dy, x (..., D), weight (D,), rstd (N,) -> dx like x, dw like weight. dy may be in another
    dtype than x (the forward's out_dtype): the kernel reads both into fp32."""
    D = x.shape[-1]
    x2 = x.contiguous().view(-1, D)
    dy2 = dy.contiguous().view(-1, D)
    N = x2.shape[0]
    block = _block("rms_norm backward", x)
    if x.is_cuda:
        programs = torch.cuda.get_device_properties(x.device).multi_processor_count
    else:
        programs = _CPU_PROGRAMS
    programs = min(N, programs)
    dx = torch.empty_like(x2)
    if N == 0:
        return dx.view(x.shape), torch.zeros_like(weight)
    dw_part = torch.empty(programs, D, device=x.device, dtype=torch.float32)  # (P, D)
    wrap_triton(_rms_norm_bwd_kernel)[(programs,)](dy2, x2, weight.contiguous(), rstd, dx, dw_part, N, D, BLOCK=block,
                                      num_warps=num_warps_for(block))
    return dx.view(x.shape), dw_part.sum(0).to(weight.dtype)


class RMSNormFn(torch.autograd.Function):
    @staticmethod
    @launches_directly
    def forward(ctx, x, weight, eps, out_dtype):
        y, rstd = rms_norm_fwd(x, weight, eps, out_dtype)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @launches_directly
    def backward(ctx, dy):
        dx, dw = rms_norm_bwd(dy, *ctx.saved_tensors)
        return dx, dw, None, None


# pipetrain::rms_norm under torch.compile (kernels/compile_ops.py registers it when a run compiles)
COMPILE_OP = declare(CompileOp(
    name="rms_norm", forward=rms_norm_fwd, backward=rms_norm_bwd,
    fake=lambda x, weight, eps, out_dtype: (torch.empty_like(x, dtype=out_dtype),
                                 x.new_empty(x.numel() // max(x.shape[-1], 1), dtype=torch.float32)),
    backward_fake=lambda dy, x, weight, rstd: (torch.empty_like(x), torch.empty_like(weight)),
    num_grads=1,  # rstd is an output only for the backward: no gradient flows into it
    saved_inputs=(0, 1), saved_outputs=(1,)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm of x over its last dim, scaled by weight, in out_dtype (None: x's); Triton or reference per
    dispatch.use_triton."""
    out_dtype = out_dtype or x.dtype
    if not use_triton(x):
        return rms_norm_ref(x, weight, eps, out_dtype)
    if torch.compiler.is_compiling():
        return forward_op("rms_norm")(x, weight, eps, out_dtype)[0]
    return RMSNormFn.apply(x, weight, eps, out_dtype)
