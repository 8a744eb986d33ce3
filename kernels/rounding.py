"""Round fp32 values to the I/O dtype inside Triton kernels the way torch does: round to nearest even.

On a GPU `x.to(tl.bfloat16)` already rounds to nearest even, but the Triton interpreter (how the tests
run these kernels on CPU) truncates instead, which would make interpreted results differ from torch's
by an ulp. round_to does the rounding with integer ops, identically compiled or interpreted; the
final .to(dtype) then only drops bits that are already zero. It costs a few integer ops per element
of memory-bound kernels. Only fp32 and bf16 are handled (the dtypes dispatch.check_dtype admits).
"""
from __future__ import annotations

from .dispatch import HAS_TRITON, triton, tl

if HAS_TRITON:
    @triton.jit
    def round_to(x, dt: tl.constexpr):
        """fp32 x -> fp32 holding x rounded to dt (bf16: keep the top 16 bits, ties to even)."""
        if dt == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            # NaN payloads in the low bits could carry into an infinity: keep NaNs as they are
            x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
        return x
