"""Float8 quantisation with one dynamic scale per tensor: the amax, then one cast that writes the float8 values
row-major, column-major, or both (the layouts torch._scaled_mm's two operands need).

scale = 2^floor(log2(fp8_max / max(amax, AMAX_EPS))), q = clamp(x * scale, -fp8_max, fp8_max) rounded to the
format (nearest, ties to even). pipetrain/parallel/tensor/fp8.py says why (its docstring); this module is
the arithmetic, which the fp8 linears call for their activations, gradients and weights.

The reference (torch ops) is what runs on the CPU and inside torch.compile, where inductor fuses the amax and
the cast into the ops that produce x (a norm, an activation, a bias add). In eager CUDA runs it cost about
twelve kernels a call: abs, amax, five scalar ops for the scale, then a float copy, a multiply, a clamp and
the cast, each a pass of its own over x (about 37 bytes an element of x), plus a separate transposing copy
where _scaled_mm needs the other layout. The Triton path is two passes:
- _amax_kernel: each program takes the max |x| over a strided share of x (a NaN anywhere gives NaN, as
  torch.amax does); torch.amax of those partial maxima is the amax (then the caller may reduce it over tp:
  `reduce_amax`, since kernels know nothing of processes);
- _cast_kernel: each program computes the scale from the amax itself (exactly: the exponent of fp8_max / amax,
  with an IEEE division; torch's log2 can round up for a quotient just below a power of two, never for a bf16
  amax), then quantises a (BM, BD) tile and stores it row-major, its transpose, or both; program (0, 0)
  stores the scale.
About 5 bytes an element (6 with both layouts) in three launches. The float8 rounding is done with integer
ops (triton_helpers.round_to) and the cast then only drops zero bits: the interpreter's fp32 -> float8 cast
truncates and mis-carries where a GPU rounds to nearest even.

Shapes: x (N, D), 2-D (callers flatten); q (N, D) row-major, q_columns the same values column-major (a
(N, D) view of a (D, N) contiguous tensor); scale an fp32 scalar.
"""
from __future__ import annotations

from typing import Callable

import torch

from .dispatch import HAS_TRITON, tl, triton, use_triton

if HAS_TRITON:
    from .triton_helpers import round_to  # a triton.jit function: defined only with triton

AMAX_EPS = 1e-12  # an all-zero tensor gets a finite scale (its values quantise to 0)
# Elements per loop iteration of an amax program, and at most this many programs (partial maxima); memory-
# bound, not tuned on a GPU (none here): 132 SMs x 8 programs keeps every SM busy on an H100.
_AMAX_BLOCK = 4096
_AMAX_PROGRAMS = 1024
# A cast program's tile: 64 x 64 elements, 8 KB of bf16 in, 4 KB of float8 out per layout (not tuned).
_TILE = 64


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The power-of-two scale that maps amax to at most the format's largest value (fp32): 2^floor(log2(r)) for
    r = fp8_max / amax, exactly. log2 rounds to the integer for an r within an ulp or so of a power of two (an
    fp32 amax just above fp8_max / 2^k gave 2^k, and amax * scale overflowed), so the power is corrected by one
    either way; the Triton cast takes the exponent of r itself, and the two agree bit for bit."""
    r = fp8_max(dtype) / amax.float().clamp(min=AMAX_EPS)
    scale = torch.exp2(torch.floor(torch.log2(r)))
    scale = torch.where(scale > r, scale * 0.5, scale)
    return torch.where(scale * 2 <= r, scale * 2, scale)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale rounded to dtype (nearest, ties to even), saturated at the format's max."""
    limit = fp8_max(dtype)
    return (x.float() * scale).clamp(-limit, limit).to(dtype)


def _columns(q: torch.Tensor) -> torch.Tensor:
    return q.t().contiguous().t()


def quantize_ref(x: torch.Tensor, dtype: torch.dtype, reduce_amax: Callable | None = None, rows: bool = True,
                 columns: bool = False) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """The spec (CPU path, inside torch.compile, test oracle): (q or None, scale, q_columns or None)."""
    scale = tensorwise_scale(x, dtype, reduce_amax)
    q = quantize(x, scale, dtype) if rows or columns else None
    return (q if rows else None), scale, (_columns(q) if columns else None)


def tensorwise_scale(x: torch.Tensor, dtype: torch.dtype, reduce_amax: Callable | None = None) -> torch.Tensor:
    """The scale (fp32 scalar) of x's amax, reduced by reduce_amax when given (torch ops)."""
    amax = x.detach().abs().amax().float().reshape(1)
    if reduce_amax is not None:
        amax = reduce_amax(amax)
    return scale_from_amax(amax, dtype).reshape(())


if HAS_TRITON:
    @triton.jit
    def _amax_kernel(x_ptr, partial_ptr, M, BLOCK: tl.constexpr):
        # program p: max |x| over blocks p, p + P, p + 2P, ... of BLOCK elements; NaN if any of them is NaN
        start = tl.program_id(0).to(tl.int64) * BLOCK
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        nans = tl.zeros([BLOCK], dtype=tl.int32)
        for block_start in range(start, M, step):
            offs = block_start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offs, mask=offs < M, other=0.0).to(tl.float32)
            nans += (x != x).to(tl.int32)
            acc = tl.maximum(acc, tl.where(x != x, 0.0, tl.abs(x)))
        m = tl.max(acc, axis=0)
        tl.store(partial_ptr + tl.program_id(0), tl.where(tl.sum(nans, axis=0) > 0, float("nan"), m))

    @triton.jit
    def _cast_kernel(x_ptr, amax_ptr, scale_ptr, q_ptr, qt_ptr, N, D, E5M2: tl.constexpr, FMAX: tl.constexpr,
                     EPS: tl.constexpr, ROWS: tl.constexpr, COLUMNS: tl.constexpr, COPY: tl.constexpr,
                     BM: tl.constexpr, BD: tl.constexpr):
        # q_ptr, qt_ptr: the float8 outputs' bytes (uint8 views), written as bits: a NaN is stored as torch's
        # (0x7F with x's sign) where the interpreter's cast of NaN gave a number. COPY: x is float8 already
        # (its bytes): only the layouts are written
        # scale from the amax, exactly: 2^(the exponent of FMAX / amax); amax inf gives 0, NaN gives NaN
        amax = tl.load(amax_ptr)
        r = tl.math.div_rn(tl.full([], FMAX, tl.float32), tl.maximum(amax, EPS))
        scale = ((r.to(tl.int32, bitcast=True) >> 23) << 23).to(tl.float32, bitcast=True)
        scale = tl.where(amax != amax, float("nan"), scale)
        pm, pd = tl.program_id(0), tl.program_id(1)
        tl.store(scale_ptr, scale, mask=(pm == 0) & (pd == 0))
        rows = pm.to(tl.int64) * BM + tl.arange(0, BM)  # int64: N * D may pass 2**31
        cols = pd.to(tl.int64) * BD + tl.arange(0, BD)
        mask = (rows[:, None] < N) & (cols[None, :] < D)
        if COPY:
            q = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0)
        else:
            dt: tl.constexpr = tl.float8e5 if E5M2 else tl.float8e4nv
            v = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32) * scale
            nan_bits = tl.where(v != v, ((v.to(tl.uint32, bitcast=True) >> 24) & 0x80) | 0x7F, 0).to(tl.uint8)
            v = tl.minimum(tl.maximum(v, -FMAX), FMAX)  # saturate (min and max may drop a NaN: put back below)
            q = round_to(v, dt).to(dt).to(tl.uint8, bitcast=True)
            q = tl.where(nan_bits != 0, nan_bits, q)
        if ROWS:
            tl.store(q_ptr + rows[:, None] * D + cols[None, :], q, mask=mask)
        if COLUMNS:
            tl.store(qt_ptr + cols[:, None] * N + rows[None, :], tl.trans(q), mask=tl.trans(mask))


def fp8_amax(x: torch.Tensor) -> torch.Tensor:
    """Launcher: max |x| as a (1,) fp32 tensor (x contiguous)."""
    M = x.numel()
    if M == 0:
        return torch.zeros(1, device=x.device)
    programs = min(triton.cdiv(M, _AMAX_BLOCK), _AMAX_PROGRAMS)
    partial = torch.empty(programs, device=x.device, dtype=torch.float32)
    _amax_kernel[(programs,)](x, partial, M, BLOCK=_AMAX_BLOCK, num_warps=8)
    return partial.amax().reshape(1)


def fp8_cast(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype, rows: bool = True,
             columns: bool = False) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Launcher: (q or None, scale, q_columns or None) of contiguous x (N, D) with the scale of amax (1,).
    x float8 (of dtype) is copied as it is, its scale 1 (fp8_columns)."""
    N, D = x.shape
    copy = x.dtype == dtype
    scale = torch.empty((), device=x.device, dtype=torch.float32)
    q = torch.empty(N, D, device=x.device, dtype=dtype) if rows else None
    qt = torch.empty(D, N, device=x.device, dtype=dtype) if columns else None
    if N and D:
        grid = (triton.cdiv(N, _TILE), triton.cdiv(D, _TILE))
        out = (q if rows else qt).view(torch.uint8)
        _cast_kernel[grid](x.view(torch.uint8) if copy else x, amax, scale, out,
                           qt.view(torch.uint8) if columns else out, N, D, E5M2=dtype == torch.float8_e5m2,
                           FMAX=fp8_max(dtype), EPS=AMAX_EPS, ROWS=rows, COLUMNS=columns, COPY=copy, BM=_TILE,
                           BD=_TILE, num_warps=4)
    else:  # nothing to cast: the scale still comes from amax
        scale.copy_(scale_from_amax(amax, dtype).reshape(()))
    return q, scale, (qt.t() if columns else None)


# float8 on NVIDIA needs compute capability 8.9 (Ada, Hopper, newer): Triton builds float8e4nv only from there
# (older cards, an A100 under train.fp8_emulate, take the reference), as torch._scaled_mm runs only from there
MIN_CAPABILITY = (8, 9)
_INPUT_DTYPES = (torch.float32, torch.bfloat16)  # the cast kernel's; others (fp16) take the reference


def kernels_build_on(device: torch.device) -> bool:
    """Whether the float8 kernels build for device: any CUDA card of compute capability >= 8.9; the CPU (the
    interpreter, when use_triton sends CPU tensors here at all)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def _takes_triton(x: torch.Tensor, dtypes: tuple) -> bool:
    return (x.dtype in dtypes and use_triton(x) and not torch.compiler.is_compiling()
            and kernels_build_on(x.device))


def quantize_tensorwise(x: torch.Tensor, dtype: torch.dtype, reduce_amax: Callable | None = None,
                        rows: bool = True, columns: bool = False
                        ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """(q or None, scale, q_columns or None): x (N, D) quantised to dtype with one scale from the amax of x,
    reduced by reduce_amax ((1,) fp32 -> (1,) fp32, e.g. a max over tp) when given. Triton in eager on CUDA
    (per dispatch.use_triton, fp32 or bf16 x, a card of compute capability >= 8.9), else the reference: on the
    CPU, an older card, and while torch.compile traces (inductor fuses it)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_tensorwise: x must be 2-D (N, D), got {tuple(x.shape)}")
    if not _takes_triton(x, _INPUT_DTYPES):
        return quantize_ref(x, dtype, reduce_amax, rows, columns)
    x = x.detach().contiguous()
    amax = fp8_amax(x)
    if reduce_amax is not None:
        amax = reduce_amax(amax)
    return fp8_cast(x, amax, dtype, rows, columns)


def fp8_columns(q: torch.Tensor) -> torch.Tensor:
    """q (N, D) float8, column-major: itself where it is already, else a copy (Triton in eager on CUDA: a tiled
    transpose; torch's copy reads one byte per row at a time)."""
    if q.t().is_contiguous():
        return q
    if not _takes_triton(q, (torch.float8_e4m3fn, torch.float8_e5m2)) or not q.is_contiguous():
        return _columns(q)
    return fp8_cast(q, torch.full((1,), fp8_max(q.dtype), device=q.device), q.dtype, rows=False, columns=True)[2]
