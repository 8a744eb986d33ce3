"""The float8 GEMM of the fp8 linears (fp8.py, fp8_rowwise.py): torch._scaled_mm on the hardware, else its fp32
emulation, with one scale per operand (tensorwise) or one per row of a and per column of b (rowwise)."""
from __future__ import annotations

import torch

from pipetrain.kernels.fp8_quant import fp8_columns
from pipetrain.parallel.mesh.comm import all_reduce_max_

# The forward GEMM (y = x W^T) accumulates fast on the hardware, the two gradient GEMMs in full: torchao's
# float8 training defaults (what torchtitan's fp8 figures used); gradients need the precision more.
FORWARD_FAST_ACCUM = True


def amax_over(*groups):
    """An amax reduction for the quantisers (quantize_tensorwise's reduce_amax): the max over every group given
    that is not None (tp's, and cp's for an amax over tokens, which cp splits), or None (no reduction)."""
    groups = [g for g in groups if g is not None]
    if not groups:
        return None

    def reduce(amax: torch.Tensor) -> torch.Tensor:
        for group in groups:
            amax = all_reduce_max_(amax, group)
        return amax
    return reduce


def hardware_shapes_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    # torch._scaled_mm wants every dim a multiple of 16
    return all(s % 16 == 0 for s in (*a.shape, b.shape[1]))


def scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype, hardware: bool, fast_accum: bool = False,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """(a / a_scale) @ (b / b_scale) (+ bias) for fp8 a (M, K), b (K, N): fp32 accumulation, out_dtype result.
    Scales: fp32 scalars (tensorwise), or a_scale (M, 1) and b_scale (1, N) (rowwise: a scale per row of a and
    per column of b, each along the summed dimension K, so each product's scale multiplies its fp32 sum).
    hardware: torch._scaled_mm (sm_89+; shapes that are not multiples of 16, and rowwise scales with a result
    other than bf16, which its rowwise kernel does not write, fall back to the emulation).
    fast_accum: the hardware's fp8 accumulation without its periodic promotion to fp32 (faster on Hopper,
    with an error that grows with K); the emulation sums in fp32 either way.
    bias (N,), in out_dtype: added in fp32 before the one rounding to out_dtype, by the GEMM's epilogue on the
    hardware for a bf16 / fp16 result (no pass of its own over the output), as the emulation does (cuBLASLt may
    add it after the rounding under some split-K algorithms: an ulp apart)."""
    rowwise = a_scale.dim() > 0
    if hardware and hardware_shapes_ok(a, b) and (not rowwise or out_dtype == torch.bfloat16):
        in_epilogue = bias is not None and out_dtype in (torch.bfloat16, torch.float16)
        # a row-major, b column-major, scales as the multipliers that dequantise
        y = torch._scaled_mm(fp8_columns(a.t()).t(), fp8_columns(b), scale_a=a_scale.reciprocal(),
                             scale_b=b_scale.reciprocal(), bias=bias if in_epilogue else None, out_dtype=out_dtype,
                             use_fast_accum=fast_accum)
        return y if bias is None or in_epilogue else y + bias
    y = torch.mm(a.float(), b.float()) * (a_scale.reciprocal() * b_scale.reciprocal())  # exact: powers of two
    return (y if bias is None else y + bias.float()).to(out_dtype)
