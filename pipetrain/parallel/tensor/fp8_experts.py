"""The experts' grouped GEMMs in float8 (train.precision: fp8 on a mixture of experts): Experts.fp8_grouped.

A MoE layer's experts are three grouped GEMMs (gate, up, down: models/moe.py, grouped_swiglu), each
y_g = x_g W_g^T for the rows x_g of expert g. Under fp8 each takes torchao's grouped rowwise scales (its MoE
float8 training; torchtitan's `quantize.grouped_mm.float8`), with the weight gradient in high precision, as
train.fp8_recipe=rowwise_with_gw_hp does for a linear (fp8_rowwise.py):
  y  = x W^T   x per row (token; amax over K), W per expert and output channel (amax over K)
  dx = dy W    dy per row (amax over N),        W per expert and input channel (amax over N)
  dW = dy^T x  per expert in the autocast dtype (bf16), from x saved in that dtype
A scale per expert is what a stack of experts needs: one scale for all of them (tensorwise) would let the
expert of the largest weights set every expert's. So the experts take this one recipe whatever
train.fp8_recipe says for the linears. Every operand is float8_e4m3fn; the scales are powers of two.

The GEMM: torch._scaled_grouped_mm on CUDA sm90 and sm100 (rowwise scales, bf16 result, dims multiples of 16),
else its emulation: the operands dequantised (exact: powers of two) and the loop over experts of
models.moe.grouped_linear in fp32, rounded once to the result dtype, as fp8_gemm.scaled_mm emulates one
GEMM. The emulation is the CPU path (train.fp8_emulate) and the fallback for shapes the kernel refuses and
cards without it (sm89 L4/L40S and sm120 RTX Blackwell run the linears on the hardware, the experts emulated).

Tensor parallelism F-shards the experts (gate/up: N split, "out"; down: K split, "in"): an amax is reduced
(max) over tp exactly where its dim is split, as for rowwise linears, so tp=2 quantises as tp=1. Context
parallelism splits tokens, and no amax here runs over tokens (dW is not quantised): nothing is reduced over
cp. Expert parallelism hands each rank every row of its experts: the same rows, the same scales.

Shapes: x (M, K) rows sorted by expert, W (E, N, K) (nn.Linear's (out, in) per expert), offs (E,) the
cumulative row counts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipetrain.kernels.dispatch import autocast_dtype
from pipetrain.kernels.fp8_quant import quantize, scale_from_amax
from pipetrain.models.moe import (grouped_linear, grouped_linear_weight_grad, grouped_mm_leaves_empty_groups,
                                  zero_empty_groups)
from pipetrain.parallel.tensor.fp8_gemm import amax_over
from pipetrain.parallel.tensor.fp8_rowwise import FEATURES, ROWWISE_DTYPE, quantize_along

SCALED_GROUPED_MM_MAJORS = (9, 10)  # torch._scaled_grouped_mm's kernels: Hopper (sm90) and B200 (sm100)


def scaled_grouped_mm_capable(capability: tuple[int, int], rocm: bool = False) -> bool:
    """Whether torch._scaled_grouped_mm runs on a CUDA card of this compute capability: sm90 and sm100 only (it
    raises on others, sm120 RTX Blackwell among them, where the experts emulate); not ROCm (its float8 is fnuz)."""
    return capability[0] in SCALED_GROUPED_MM_MAJORS and not rocm


def quantize_per_expert(w: torch.Tensor, dim: int, reduce=None) -> tuple[torch.Tensor, torch.Tensor]:
    """w (E, N, K) in float8_e4m3fn with a power-of-two scale per expert and row (dim 2: amax over K, scales
    (E, N, 1)) or per expert and column (dim 1: amax over N, scales (E, 1, K)); reduce: the max over tp."""
    amax = w.detach().abs().amax(dim=dim, keepdim=True).float()
    if reduce is not None:
        amax = reduce(amax)
    scale = scale_from_amax(amax, ROWWISE_DTYPE)
    return quantize(w, scale, ROWWISE_DTYPE), scale


def scaled_grouped_mm_ok(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, hardware: bool) -> bool:
    """torch._scaled_grouped_mm's conditions: the hardware asked for, a card scaled_grouped_mm_capable, bf16
    results, and K and N multiples of 16 (its 16-byte alignment of float8 rows and columns)."""
    return (hardware and a.is_cuda and out_dtype == torch.bfloat16 and hasattr(torch, "_scaled_grouped_mm")
            and scaled_grouped_mm_capable(torch.cuda.get_device_capability(a.device), torch.version.hip is not None)
            and a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0)


def grouped_scaled_mm(aq: torch.Tensor, a_scale: torch.Tensor, bq: torch.Tensor, b_scale: torch.Tensor,
                      offs: torch.Tensor, out_dtype: torch.dtype, hardware: bool) -> torch.Tensor:
    """Rows of group g of (aq / a_scale) (M, K) times (bq[g] / b_scale[g])^T -> (M, N) in out_dtype, for float8
    aq, bq (E, N, K) with a_scale (M, 1) per row and b_scale (E, N, 1) per row of each bq[g], both along K."""
    if scaled_grouped_mm_ok(aq, bq, out_dtype, hardware):
        # a row-major, b (E, K, N) column-major (a copy where bq is a transposed view: dx's W); the scales as
        # the multipliers that dequantise, (M,) and (E, N)
        return torch._scaled_grouped_mm(aq.contiguous(), bq.contiguous().transpose(-2, -1),
                                        a_scale.reciprocal().reshape(-1).contiguous(),
                                        b_scale.reciprocal().squeeze(-1).contiguous(),
                                        offs=offs.to(torch.int32), out_dtype=out_dtype)
    a = aq.float() * a_scale.reciprocal()  # exact: powers of two, so fp32 sums of products as the kernel's
    b = bq.float() * b_scale.reciprocal()
    with torch.autocast(aq.device.type, enabled=False):  # the loop's F.linear in fp32, as the kernel sums
        return grouped_linear(a, b, offs).to(out_dtype)


def grouped_mm_weight_grad_ok(dy: torch.Tensor, x: torch.Tensor) -> bool:
    """torch._grouped_mm for dW (its 2-D x 2-D form, groups along the summed rows): CUDA sm90+, bf16, N and K
    multiples of 8 (16-byte strides). The rows (tokens) need none: grouped_weight_grad's layouts."""
    return (dy.is_cuda and dy.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(dy.device) >= (9, 0)
            and dy.shape[1] % 8 == 0 and x.shape[1] % 8 == 0)


def grouped_weight_grad(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E, N, K): dy_g^T x_g of every expert, in dy's dtype with fp32 sums: torch._grouped_mm (its 2-D x 2-D
    form, groups along the rows) for bf16 on sm90+, else the loop over experts (models.moe)."""
    if grouped_mm_weight_grad_ok(dy, x):
        # dy^T as a column-major view, as torch's own _grouped_mm backward passes its dW operand: a row-major
        # copy would make the kernel check each group's rows along the summed dim for 16-byte alignment (a
        # device-side assert unless every expert's row count is a multiple of 8; torchao and torchtitan pad
        # the groups for it), where the column-major one needs only N and K aligned
        dw = torch._grouped_mm(dy.contiguous().t(), x.contiguous(), offs=offs.to(torch.int32))
        return zero_empty_groups(dw, offs) if grouped_mm_leaves_empty_groups(dy.device) else dw
    with torch.autocast(dy.device.type, enabled=False):
        return grouped_linear_weight_grad(dy, x, offs, num_experts)


class _Fp8GroupedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, spec: "Fp8Experts", split: str):
        out_dtype = autocast_dtype(x) or x.dtype
        reduce_k = amax_over(spec.tp_group) if split == "in" else None  # K split over tp
        xq, x_scale = quantize_along(x, FEATURES, reduce_k)
        wq, w_scale = quantize_per_expert(weight, 2, reduce_k)
        y = grouped_scaled_mm(xq, x_scale, wq, w_scale, offs, out_dtype, spec.hardware)
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            # W per input channel for dx (its amax over N, split under "out"), x for the bf16 dW
            wq_in, w_in_scale = quantize_per_expert(weight, 1, amax_over(spec.tp_group) if split == "out" else None)
            ctx.save_for_backward(x.to(out_dtype), wq_in, w_in_scale, offs)
        ctx.spec, ctx.split, ctx.x_dtype, ctx.w_dtype, ctx.out_dtype = spec, split, x.dtype, weight.dtype, out_dtype
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_hp, wq_in, w_in_scale, offs = ctx.saved_tensors
        spec, dx, dw = ctx.spec, None, None
        if ctx.needs_input_grad[0]:
            gq, g_scale = quantize_along(dy, FEATURES, amax_over(spec.tp_group) if ctx.split == "out" else None)
            # dx_g = dy_g W_g: W_g^T (K, N) per row k is W's column k, with its scale along N
            dx = grouped_scaled_mm(gq, g_scale, wq_in.transpose(-2, -1), w_in_scale.transpose(-2, -1), offs,
                                   ctx.out_dtype, spec.hardware).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dw = grouped_weight_grad(dy.to(x_hp.dtype), x_hp, offs, wq_in.shape[0]).to(ctx.w_dtype)
        return dx, dw, None, None, None


@dataclass(frozen=True)
class Fp8Experts:
    """An Experts module's fp8 setting (its `fp8_grouped` attribute, read by models.moe.grouped_swiglu): callable as one
    grouped GEMM (x (M, K), weight (E, N, K), offs, split) -> (M, N), split "out" for gate/up (column-parallel
    under tp) and "in" for down. tp_group: amaxes reduced over it where tp splits their dim (None at tp=1);
    hardware: torch._scaled_grouped_mm where scaled_grouped_mm_ok, else emulated."""
    tp_group: object = None
    hardware: bool = False

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, split: str) -> torch.Tensor:
        return _Fp8GroupedLinearFn.apply(x, weight, offs, self, split)
