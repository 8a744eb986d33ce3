"""Small pieces shared by the Triton kernels: rounding to the I/O dtype and the num_warps rule.

round_to: on a GPU `x.to(tl.bfloat16)` rounds to nearest even, but the Triton interpreter (how the
tests run these kernels on CPU) truncates, which would make interpreted results differ from torch's by
an ulp. round_to rounds with integer ops, identically compiled or interpreted; the final .to(dtype)
then only drops bits that are already zero. It costs a few integer ops per element of memory-bound
kernels. Only fp32 and bf16 are handled (the dtypes dispatch.check_dtype admits).
"""
from __future__ import annotations

from .dispatch import HAS_TRITON, triton, tl

# A row (or tile) must fit in one program: 64 KB is the limit the Triton layer-norm tutorial uses,
# beyond which registers spill. Launchers raise ValueError past it.
MAX_FUSED_BYTES = 65536


def num_warps_for(block: int) -> int:
    """The Triton tutorials' rule for row kernels: one warp per 256 elements, 1 to 8 warps (not tuned here)."""
    return min(max(block // 256, 1), 8)


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
