"""Small pieces shared by the Triton kernels: rounding to the I/O dtype and the num_warps rule.

round_to: on a GPU `x.to(tl.bfloat16)` rounds to nearest even, but the Triton interpreter (how the
tests run these kernels on CPU) truncates, which would make interpreted results differ from torch's by
an ulp (and to float8 it truncates and mis-carries: 31.07 became 16). round_to rounds with integer ops,
identically compiled or interpreted; the final .to(dtype) then only drops bits that are already zero. It
costs a few integer ops per element of memory-bound kernels. fp32, bf16 and the two float8 formats of fp8
training (float8_e4m3fn, float8_e5m2: values within the format's range, as after a saturating clamp).
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
        elif dt == tl.float8e4nv:  # float8_e4m3fn: 3 mantissa bits, normals from 2^-6
            x = _round_mantissa(x, 3, -6)
        elif dt == tl.float8e5:  # float8_e5m2: 2 mantissa bits, normals from 2^-14
            x = _round_mantissa(x, 2, -14)
        return x

    @triton.jit
    def _round_mantissa(x, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
        """fp32 x rounded (ties to even) to MANT mantissa bits, and below 2^MIN_EXP to multiples of
        2^(MIN_EXP - MANT) (the format's subnormals). The significand with its implicit bit, m (2^23 to 2^24),
        is rounded to a multiple of 2^drop: value = m * 2^(e - 150) for the biased exponent e."""
        bits = x.to(tl.int32, bitcast=True)
        e = (bits >> 23) & 0xFF
        m = (bits & 0x7FFFFF) | 0x800000
        # bits dropped: 23 - MANT, more below the format's normals; from 25 on the value rounds to 0
        drop = tl.minimum((23 - MANT) + tl.maximum((MIN_EXP + 127) - e, 0), 25)
        m = ((m + (1 << (drop - 1)) - 1 + ((m >> drop) & 1)) >> drop) << drop
        unit = (tl.maximum(e - 23, 1) << 23).to(tl.float32, bitcast=True)  # 2^(e - 150); any e when m is 0
        rounded = (m.to(tl.float32) * unit).to(tl.int32, bitcast=True) | (bits & -0x80000000)  # x's sign
        return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))
