"""Rowwise fp8 scaling (train.fp8_recipe: rowwise): a scale per row of each GEMM operand, along the dimension the
GEMM sums over, where the tensorwise recipe (fp8.py) gives each of x, W and dy one scale.

Why: under one scale per tensor, one outlier (a token with a huge activation, an output channel with large
weights) sets the scale of every value; the rows of small values then keep fewer mantissa bits (they fall
into float8's subnormals) or become zero. Per row, each token and each channel gets the scale of its own amax.
This is torchao's `rowwise` float8 training recipe (torchtitan's `float8.recipe_name: rowwise`).

The scales of the three GEMMs (each a power of two, scale_from_amax per row, as tensorwise's per tensor):
  y  = x W^T   x per token (amax over D_in),         W per output channel (amax over D_in)
  dx = dy W    dy per token (amax over D_out),       W per input channel (amax over D_out)
  dW = dy^T x  dy per output channel (amax over N),  x per input channel (amax over N)
Each left operand has a scale per row and each right operand one per column, both along the summed dimension,
so product (i, j) dequantises exactly with a_i b_j after its fp32 sum (torch._scaled_mm's rowwise epilogue on
the hardware; fp8_gemm.scaled_mm). Each of x, W and dy is therefore quantised twice, once along each axis.
- Every operand is float8_e4m3fn, gradients too: a scale per token gives dy the range that tensorwise buys with
  e5m2's exponent bits (torchao's rowwise recipe does the same).
- The forward saves x quantised per input channel and each W per input channel (one byte an element each, as
  tensorwise saves its xq and Wq); the backward quantises dy both ways.
- torch._scaled_mm's rowwise kernel writes bf16 only, so the three GEMMs give the autocast dtype: dW is rounded
  to bf16, then cast to the weight's dtype (tensorwise's dW GEMM writes fp32); dx parts are summed in x's dtype.
  The emulation (CPU, train.fp8_emulate) rounds the same way; without autocast (fp32 results) both paths emulate.

Tensor parallelism: an amax is reduced (max) over tp exactly where its axis is split over the tp ranks:
- column-parallel linears (wq, wk, wv, gate, up; D_out split: tp_split "out"): dy per token, W per input channel;
- row-parallel linears (wo, down; D_in split: tp_split "in"): x per token, W per output channel.
The others run along an axis each rank holds whole (sequence parallelism gathers the tokens before the GEMM),
so tp=2 quantises exactly as tp=1; the reductions are all-reduces of (N, 1) or (1, D) tensors, not scalars.
Context parallelism splits the tokens: the amaxes over tokens (x and dy per channel, for rowwise's dW) are
reduced over cp; the per-token ones and the weights' need nothing (rowwise_with_gw_hp reduces nothing over cp).

Not with rowwise (yet): the Triton casts of kernels/fp8_quant.py (tensorwise kernels; rowwise runs the torch
reference, which inductor fuses under train.compile), the once-a-run weight cache (it holds one tensorwise
quantisation of each weight: build.fp8_weights_once_a_run keeps it off) and ZeRO-3's float8 gather (ZeRO-3
gathers these weights in fp32 instead, and the linear quantises them as at zero 1: parallel/data/zero3.py).

train.fp8_recipe=rowwise_with_gw_hp (torchao's and torchtitan's recipe of that name; Fp8Linear.weight_grad_hp):
  y  = x W^T   as rowwise
  dx = dy W    dy per token, W with one scale (tensorwise, its amax reduced over tp)
  dW = dy^T x  in high precision: the autocast dtype's GEMM (bf16), from x saved in that dtype
Each of x and dy is then quantised once (along the dimension the next GEMM sums), W twice, and the weight
gradient keeps bf16's 8 mantissa bits where rowwise gives it e4m3's 3, at the cost of a bf16 GEMM (a third of
the linear's FLOPs at half fp8's peak) and x saved in two bytes an element instead of one.

Shapes: x (..., D_in) flattened to (N, D_in), W (D_out, D_in), dy (N, D_out).
"""
from __future__ import annotations

from typing import Callable

import torch

from pipetrain.kernels.dispatch import autocast_dtype
from pipetrain.kernels.fp8_quant import quantize, quantize_tensorwise, scale_from_amax
from pipetrain.parallel.tensor.fp8_gemm import FORWARD_FAST_ACCUM, amax_over, scaled_mm

ROWWISE_DTYPE = torch.float8_e4m3fn  # every operand: x, W and dy
TOKENS, FEATURES = 0, 1  # the dim of a 2-D operand an amax runs along


def quantize_along(t: torch.Tensor, dim: int, reduce: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """t (R, C) in float8_e4m3fn with one power-of-two scale per row (dim 1: amax over the columns, scale (R, 1))
    or per column (dim 0: scale (1, C)); reduce: the amaxes' max over the tp ranks that split that dim."""
    amax = t.detach().abs().amax(dim=dim, keepdim=True).float()
    if reduce is not None:
        amax = reduce(amax)
    scale = scale_from_amax(amax, ROWWISE_DTYPE)
    return quantize(t, scale, ROWWISE_DTYPE), scale


def _reduce(spec, split: str) -> Callable | None:
    """The amax reduction of an operand whose summed dim is `split` ("in": D_in, "out": D_out) for spec's linear:
    the max over its tp group where tp splits that dim, else None."""
    return amax_over(spec.tp_group) if spec.tp_split == split else None


def rowwise_forward(x: torch.Tensor, specs: tuple, params: tuple, backward: bool = True) -> tuple[list, list]:
    """fp8.py's _forward with rowwise scales: the outputs of linears (specs; each one's weight and bias or None in
    params) on x, and what the backward needs (backward: False under no_grad, which skips those casts): x
    quantised per input channel and its scales, then each weight quantised per input channel and its scales;
    under weight_grad_hp x in the autocast dtype, then each weight quantised with one scale, and that scale."""
    out_dtype = autocast_dtype(x) or x.dtype
    hp = specs[0].weight_grad_hp
    x2 = x.reshape(-1, x.shape[-1])  # (N, D_in)
    xq, x_scale = quantize_along(x2, FEATURES, _reduce(specs[0], "in"))  # one input: one tp split for all
    per_channel = [] if hp or not backward else quantize_along(x2, TOKENS, amax_over(specs[0].cp_group))
    saved = ([x2.to(out_dtype)] if hp else list(per_channel)) if backward else []
    outputs = []
    for spec, weight, bias in zip(specs, params[0::2], params[1::2]):
        wq, w_scale = quantize_along(weight, FEATURES, _reduce(spec, "in"))
        with torch.autocast(x.device.type, enabled=False):
            y = scaled_mm(xq, x_scale, wq.t(), w_scale.t(), out_dtype, spec.hardware, fast_accum=FORWARD_FAST_ACCUM,
                          bias=None if bias is None else bias.to(out_dtype))
        outputs.append(y.view(*x.shape[:-1], weight.shape[0]))
        if backward and hp:
            wq, w_scale, _ = quantize_tensorwise(weight, ROWWISE_DTYPE, amax_over(spec.tp_group))
            saved += [wq, w_scale]
        elif backward:
            saved += quantize_along(weight, TOKENS, _reduce(spec, "out"))  # W (D_out, D_in): per input channel
    return outputs, saved


def rowwise_backward(ctx, dys: tuple) -> tuple[torch.Tensor | None, list]:
    """fp8.py's _backward with rowwise scales: (dx or None, [dW, db] of each linear), from ctx (the saved tensors
    of rowwise_forward; specs, x_dtype, out_dtype, w_dtypes, has_bias, needs_input_grad) and the outputs' dys."""
    hp = ctx.specs[0].weight_grad_hp
    if hp:
        x_hp, *weights = ctx.saved_tensors
    else:
        xq, x_scale, *weights = ctx.saved_tensors
    dx, grads = None, []
    for i, (spec, dy) in enumerate(zip(ctx.specs, dys)):
        dw = db = None
        if dy is not None:
            dy2 = dy.reshape(-1, dy.shape[-1])  # (N, D_out)
            if ctx.needs_input_grad[0]:
                gq, g_scale = quantize_along(dy2, FEATURES, _reduce(spec, "out"))
                wq, w_scale = weights[2 * i], weights[2 * i + 1]
                if hp:  # the weight's one scale as the per-column scales (1, D_in) _scaled_mm's rowwise kernel takes
                    w_scale = w_scale.reshape(1, 1).expand(1, wq.shape[1]).contiguous()
                part = scaled_mm(gq, g_scale, wq, w_scale, ctx.out_dtype, spec.hardware).to(ctx.x_dtype)
                dx = part if dx is None else dx + part
            if ctx.needs_input_grad[2 + 2 * i] and hp:  # dy^T x in the autocast dtype, fp32 sums
                dw = torch.mm(dy2.t().to(x_hp.dtype), x_hp).to(ctx.w_dtypes[i])
            elif ctx.needs_input_grad[2 + 2 * i]:
                gq, g_scale = quantize_along(dy2, TOKENS, amax_over(spec.cp_group))  # scales (1, D_out): dy^T per row
                dw = scaled_mm(gq.t(), g_scale.t(), xq, x_scale, ctx.out_dtype, spec.hardware).to(ctx.w_dtypes[i])
            if ctx.has_bias[i] and ctx.needs_input_grad[3 + 2 * i]:
                db = dy2.sum(0, dtype=torch.float32)
        grads += [dw, db]
    return dx, grads
