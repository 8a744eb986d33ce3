"""FP8 training of the transformer's linears (train.precision: fp8): float8 operands, dynamic tensorwise scales.

Which linears: the attention projections (wq, wk, wv, wo) and the MLP (gate, up, down) of every block
(FP8_PLAN). The embedding, the LM head and the norms stay as they are; everything outside these matmuls runs
under bf16 autocast, as train.precision=bf16 does. Parameters (the master weights) and optimizer state stay fp32.

The math of one linear y = x W^T + b (the recipe torchao's tensorwise float8 training and Transformer Engine's
HYBRID format use):
- forward operands x and W in float8_e4m3fn (3 mantissa bits, max 448);
- the gradient dy in float8_e5m2 (2 mantissa bits, max 57344: gradients need range more than precision);
- each of x, W and dy gets one dynamic scale per tensor, recomputed at every call from the tensor itself:
  scale = 2^floor(log2(fp8_max / amax)), so amax * scale <= fp8_max (no overflow) and the scale is a power of
  two (dequantising multiplies exactly, and emulation equals the hardware's math up to summation order);
- quantise: q = clamp(v * scale, -fp8_max, fp8_max).to(fp8) (the clamp saturates: a cast of an out-of-range
  value to float8_e4m3fn gives NaN); dequantise: q / scale;
- the three matmuls y = xq Wq^T, dx = dyq Wq, dW = dyq^T xq accumulate in fp32 and multiply by both inverse
  scales (on the hardware, y with fast accumulation: FORWARD_FAST_ACCUM); y and dx come out in the autocast
  dtype (bf16) or x's dtype, dW in the weight's dtype (fp32); db = sum(dy) in high precision.
The amaxes and casts are pipetrain.kernels.fp8_quant's: Triton kernels in eager CUDA runs (an amax pass, then one
cast that also writes the column-major copy the hardware's dW GEMM reads), the torch reference on the CPU and
inside torch.compile, where inductor fuses them into the ops around them.
No scale is state: nothing carries from one step to the next (no amax history), so a checkpoint holds no fp8
state and a resumed run continues bit for bit.

Hardware: the real path is torch._scaled_mm, which needs an NVIDIA GPU of compute capability 8.9 or newer
(Ada L4/L40S, Hopper H100/H200, Blackwell). Elsewhere (CPU, or train.fp8_emulate=true) the same math is
emulated: the fp8 values are cast to fp32 and multiplied in fp32. A CUDA GPU older than 8.9 is refused
(fp8_problem) unless train.fp8_emulate=true asks for the emulation explicitly (slow: for checking numerics).

Layouts: a scale must be the full tensor's, so a tensor-parallel rank all-reduces its amax (max) over tp for
all three operands (a column-parallel weight and its dy, a row-parallel weight and its x are shards; the
others are replicated and the reduction returns their own amax): tp=2 quantises exactly as tp=1. The scales
are per microbatch, so layouts that put the same sequences in each microbatch (pp with the same
parallel.microbatches; dp x microbatches constant) quantise alike. Replicated kv heads (n_kv_heads < tp) are
refused: each rank's kv gradient is a partial sum there, and fp8 rounding of partial sums is not tp=1's.
Context parallelism splits the tokens: x's and dy's amaxes are reduced over cp too (the weights are whole on
every cp rank), so cp=2 quantises exactly as cp=1, and dW's sum over tokens is split over the cp ranks and
summed with the other gradients (tests/dist/test_fp8_context_parallel.py).

Linears of one input (the attention's wq, wk, wv; a gated MLP's gate and up) run as one autograd function
(fp8_linears, models.decoder.linears_of_one_input): x is quantised and saved once for all of them, where a
call per linear made and saved a float8 copy each (three per layer for q, k, v in the H200's profile).

Several microbatches a step (gradient accumulation, pipeline schedules): Fp8WeightCache quantises each weight
once per executor run into an Fp8Weight the linear reads (the weights do not change within a run, so the
values are the same), where each call quantised it again. Under no_grad (evaluation) the linears run without
the autograd Function (_apply).

train.fp8_recipe=rowwise takes a scale per row of each GEMM operand instead, and rowwise_with_gw_hp also computes
dW in high precision (fp8_rowwise.py: the same Function, Fp8Linear.rowwise); this docstring is the tensorwise
recipe, the default.

The weight gradient goes through autograd (not fused into .grad, not deferred by the split backward): the
fp8 dW needs the quantised dy of the same call, and split backward still works, with dW computed in B.

Shapes: x (..., D_in) flattened to (N, D_in), W (D_out, D_in), dy (N, D_out).
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
from dataclasses import dataclass

import torch
import torch.nn as nn

from pipetrain.config import ConfigError, ModelConfig
from pipetrain.kernels.dispatch import autocast_dtype
from pipetrain.kernels.fp8_quant import (MIN_CAPABILITY, fp8_columns, quantize,  # _scaled_mm's floor too
                                         quantize_tensorwise, scale_from_amax, tensorwise_scale)
from pipetrain.models.moe import Experts
from pipetrain.parallel.tensor.fp8_gemm import FORWARD_FAST_ACCUM, amax_over, hardware_shapes_ok, scaled_mm
from pipetrain.parallel.tensor.fp8_rowwise import rowwise_backward, rowwise_forward
from pipetrain.parallel.tensor.fp8_experts import Fp8Experts
from pipetrain.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from pipetrain.parallel.mesh.comm import all_reduce_max_
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.pipeline.weight_grads import WeightGradModule

FORWARD_DTYPE = torch.float8_e4m3fn   # x and W
GRAD_DTYPE = torch.float8_e5m2        # dy
FP8_PLAN = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.gate", "mlp.up", "mlp.down")
_LAYER_PREFIX = re.compile(r"^layers\.\d+\.")


def tensor_scale(x: torch.Tensor, dtype: torch.dtype, tp_group=None) -> torch.Tensor:
    """Scale of the whole tensor: its amax, reduced (max) over tp_group when x is one rank's part of it."""
    return tensorwise_scale(x, dtype, amax_over(tp_group))


def _forward(x: torch.Tensor, specs: tuple, params: tuple, backward: bool = True) -> tuple[list, list]:
    """The outputs of linears (specs, then each one's weight and bias or None in params) on x, and the tensors
    their backward needs: xq and its scale, then each linear's float8 weight (as dx = dy W reads it) and scale.
    (backward: rowwise_forward's; here the saved tensors are those the forward makes anyway.)"""
    device = x.device.type
    out_dtype = autocast_dtype(x) or x.dtype
    x2 = x.reshape(-1, x.shape[-1])  # (N, D_in)
    xq, x_scale, _ = quantize_tensorwise(x2, FORWARD_DTYPE, amax_over(specs[0].tp_group, specs[0].cp_group))
    outputs, saved = [], [xq, x_scale]
    for spec, weight, bias in zip(specs, params[0::2], params[1::2]):
        wq_backward = None  # dx = dy W's operand: wq, or its column-major copy for the hardware's GEMM
        if spec.gathered is not None and spec.gathered.current:  # quantised already: ZeRO-3 or Fp8WeightCache
            wq, w_scale = spec.gathered.data, spec.gathered.scale
            if spec.gathered.columns is not None and all(n % 16 == 0 for n in (x2.shape[0], *wq.shape)):
                wq_backward = spec.gathered.columns  # (else scaled_mm emulates dx, from wq as it is)
        else:
            wq, w_scale, _ = quantize_tensorwise(weight, FORWARD_DTYPE, amax_over(spec.tp_group))
        with torch.autocast(device, enabled=False):
            y = scaled_mm(xq, x_scale, wq.t(), w_scale, out_dtype, spec.hardware, fast_accum=FORWARD_FAST_ACCUM,
                          bias=None if bias is None else bias.to(out_dtype))
        outputs.append(y.view(*x.shape[:-1], weight.shape[0]))
        saved += [wq if wq_backward is None else wq_backward, w_scale]
    return outputs, saved


def _backward(ctx, dys: tuple) -> tuple[torch.Tensor | None, list]:
    """(dx or None, [dW, db] of each linear) from _forward's saved tensors in ctx and the outputs' dys."""
    xq, x_scale, *weights = ctx.saved_tensors
    dx, grads = None, []
    # dW = dyq^T xq: torch._scaled_mm wants xq column-major, transposed here once for all the linears (the
    # emulation takes it as it is: a column-major operand can change the CPU GEMM's summation order)
    hardware_dw = ctx.specs[0].hardware and hardware_shapes_ok(xq.t(), xq)
    xq_columns = fp8_columns(xq) if hardware_dw and any(ctx.needs_input_grad[2::2]) else xq
    for i, (spec, dy) in enumerate(zip(ctx.specs, dys)):
        wq, w_scale = weights[2 * i], weights[2 * i + 1]
        dw = db = None
        if dy is not None:
            dy2 = dy.reshape(-1, dy.shape[-1])  # (N, D_out)
            need_dw = ctx.needs_input_grad[2 + 2 * i]
            # dW = dyq^T xq takes dyq^T row-major on the hardware: the cast writes dyq column-major too
            columns = need_dw and hardware_dw and dy2.shape[1] % 16 == 0  # (else dW is emulated)
            gq, g_scale, gq_columns = quantize_tensorwise(dy2, GRAD_DTYPE, amax_over(spec.tp_group, spec.cp_group),
                                                          columns=columns)
            if ctx.needs_input_grad[0]:
                part = scaled_mm(gq, g_scale, wq, w_scale, ctx.x_dtype, spec.hardware)
                dx = part if dx is None else dx + part
            if need_dw:
                dw = scaled_mm((gq if gq_columns is None else gq_columns).t(), g_scale, xq_columns, x_scale,
                               ctx.w_dtypes[i], spec.hardware)
            if ctx.has_bias[i] and ctx.needs_input_grad[3 + 2 * i]:
                db = dy2.sum(0, dtype=torch.float32)  # on CUDA: fp32 sums of bf16 reads, no fp32 copy
        grads += [dw, db]
    return dx, grads


class _Fp8LinearsFn(torch.autograd.Function):
    """y_i = x W_i^T + b_i for linears i of one input x, with float8 operands (module docstring): x is
    quantised once for all of them and saved once (1 byte an element), as is each W_i. One linear is the case
    of one. Inputs: x, the linears' Fp8Linear specs, then each linear's weight and bias (None: none).
    Tensorwise scales (_forward, _backward), or rowwise (fp8_rowwise.py) where the specs say so."""

    @staticmethod
    def forward(ctx, x, specs: tuple, *params):
        ctx.set_materialize_grads(False)  # an output nothing uses gives its weight no gradient, as its own call did
        outputs, saved = (rowwise_forward if specs[0].rowwise else _forward)(x, specs, params)
        ctx.save_for_backward(*saved)
        ctx.specs, ctx.x_dtype, ctx.x_shape, ctx.out_dtype = specs, x.dtype, x.shape, autocast_dtype(x) or x.dtype
        ctx.w_dtypes, ctx.has_bias = [w.dtype for w in params[0::2]], [b is not None for b in params[1::2]]
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *dys):
        dx, grads = (rowwise_backward if ctx.specs[0].rowwise else _backward)(ctx, dys)
        return None if dx is None else dx.view(ctx.x_shape), None, *grads


def _apply(x: torch.Tensor, specs: tuple, params: tuple) -> tuple[torch.Tensor, ...]:
    """The linears on x: through _Fp8LinearsFn, or without autograd under no_grad (evaluation, sampling), where
    torch.compile (2.13) would pass the Function's forward its arguments shifted by one (tests/unit/test_fp8_cache.py
    evaluates compiled blocks)."""
    if not torch.is_grad_enabled():
        return tuple((rowwise_forward if specs[0].rowwise else _forward)(x, specs, params, backward=False)[0])
    return _Fp8LinearsFn.apply(x, specs, *params)


def fp8_linears(x: torch.Tensor, linears: tuple[nn.Module, ...]) -> tuple[torch.Tensor, ...]:
    """The fp8 linears of one input x together: x quantised and saved once (models.decoder.linears_of_one_input's
    shared callable, which apply_fp8 gives the attention's wq, wk, wv and a gated MLP's gate, up). A LoRA-adapted
    linear (models.lora.LoRAAdapted) adds its adapter's output to its frozen fp8 base's, as its forward does."""
    params = tuple(t for linear in linears for t in (linear.weight, linear.bias))
    outputs = _apply(x, tuple(linear.fp8 for linear in linears), params)
    return tuple(y + linear.lora_delta(x) if hasattr(linear, "lora_delta") else y
                 for y, linear in zip(outputs, linears))


class Fp8Weight:
    """A weight quantised ahead of the linear's call, which reads it instead of quantising the weight:
    data, the quantised whole weight (D_out, D_in) float8_e4m3fn; scale, the fp32 scalar it was quantised with
    (the whole weight's, from weight_scales); columns, None or the same values column-major (the hardware's
    operand layout for dx = dy W, so no backward transposes it).
    current: whether the linear reads it (else it quantises its weight itself).
    - ZeRO-3 gathers into it (pipetrain/parallel/data/zero3.py): data's storage is freed and refilled with its
      unit (held: False), and the linear's fp32 parameter holds no values: its rows are the master. Always
      current (its unit's hooks gather it before every call).
    - Fp8WeightCache fills it once per executor run from the weight (held: True), current only inside the run."""

    def __init__(self, shape: torch.Size, device: torch.device, held: bool = False, columns: bool = False):
        self.data = torch.empty(shape, dtype=FORWARD_DTYPE, device=device)
        if not held:
            self.data.untyped_storage().resize_(0)  # gathered with its unit; until then it holds nothing
        self.columns = torch.empty(shape[::-1], dtype=FORWARD_DTYPE, device=device).t() if columns else None
        self.scale = torch.ones((), device=device)
        self.current = not held


def weight_scales(shards: list, groups: list, device: torch.device) -> torch.Tensor:
    """The float8_e4m3fn scales of whole weights from every rank's part of each: shards, this rank's rows of
    each weight (None: it holds none); groups, the process groups the parts are spread over (dp, and tp
    for a tp-sharded weight, as tensor_scale reduces it). One all-reduce (max) per group for all the
    weights together. Returns (len(shards),) fp32 on device (the groups' backend's), equal to tensor_scale of
    each whole weight."""
    held = [i for i, s in enumerate(shards) if s is not None and s.numel()]
    amax = torch.zeros(len(shards), device=device)
    if held:  # max |w| of each, exact: one multi-tensor kernel for them all
        norms = torch._foreach_norm([shards[i].detach() for i in held], float("inf"))
        amax[held] = torch.stack(norms).float().to(device)
    for group in groups:
        amax = all_reduce_max_(amax, group)
    return scale_from_amax(amax, FORWARD_DTYPE)


def _fill(weight: torch.Tensor, scale: torch.Tensor, holder: Fp8Weight) -> None:
    """holder = weight quantised with scale (its columns too, when it has them)."""
    holder.data.copy_(quantize(weight, scale, FORWARD_DTYPE))
    if holder.columns is not None:
        holder.columns.copy_(holder.data)
    holder.scale.copy_(scale)


class Fp8WeightCache:
    """Every fp8 linear's weight quantised once per executor run (a training step, an evaluation batch), into an
    Fp8Weight its linear reads, where each call quantised it again: under k microbatches a step (gradient
    accumulation, or a pipeline schedule's k forwards of each chunk) k amaxes and casts of each weight, and under
    a pipeline schedule a float8 copy of it saved for backward by each microbatch in flight. The weights do not
    change within a run, so every value is what each call's own quantisation gave, bit for bit; the holders cost
    one byte a weight element (two on the hardware path, which also keeps the column-major copy dx = dy W
    reads, where each backward transposed it). build_trainer makes one under train.precision=fp8 with several
    microbatches a step and ZeRO below 3 (ZeRO-3 gathers its weights quantised already).
    run() brackets an executor run: it quantises first, and the holders are current only until the run ends.
    Outside a run (the end-of-run sample, which calls the blocks' modules itself) the linears quantise their
    weights in each call, as without the cache: the weights may have changed since the last run.
    compile_backend: the per-weight quantisation as one compiled kernel (train.compile), else eager ops."""

    def __init__(self, model: nn.Module, compile_backend: str | None = None):
        self.entries: list[tuple[torch.Tensor, Fp8Weight]] = []
        self.groups: list = []
        for module in model.modules():
            spec = getattr(module, "fp8", None)
            if spec is None or spec.gathered is not None:
                continue
            holder = Fp8Weight(module.weight.shape, module.weight.device, held=True, columns=spec.hardware)
            module.fp8 = dataclasses.replace(spec, gathered=holder)
            self.entries.append((module.weight, holder))
            self.groups = [spec.tp_group] if spec.tp_group is not None else []  # every fp8 linear's tp group
        self._fill = _fill if compile_backend is None else torch.compile(_fill, fullgraph=True, dynamic=False,
                                                                          backend=compile_backend)

    @torch.no_grad()
    def refresh(self) -> None:
        """Quantise every weight into its holder: the scales as tensor_scale takes them (the amaxes, one
        multi-tensor kernel for them all, reduced over tp in one all-reduce), then one quantisation apiece."""
        if not self.entries:
            return
        weights = [weight for weight, _ in self.entries]
        scales = weight_scales(weights, self.groups, weights[0].device)
        for (weight, holder), scale in zip(self.entries, scales):
            self._fill(weight, scale, holder)

    def _set_current(self, current: bool) -> None:
        for _, holder in self.entries:
            holder.current = current

    @contextlib.contextmanager
    def run(self):
        self.refresh()
        self._set_current(True)
        try:
            yield
        finally:
            self._set_current(False)


@dataclass(frozen=True)
class Fp8Linear:
    """A module's fp8 setting (its `fp8` attribute, read by weight_grads.linear): callable as the linear.
    tp_group: amaxes are reduced over it (None at tp=1); hardware: torch._scaled_mm, else emulated;
    gathered: the weight ZeRO-3 gathered in float8 (then the weight argument is not read), else None;
    rowwise: train.fp8_recipe=rowwise (fp8_rowwise.py), where tp_split says which dim tp splits: "out"
    (column-parallel), "in" (row-parallel), None at tp=1 (tensorwise reduces every amax, and needs no split);
    weight_grad_hp (with rowwise): train.fp8_recipe=rowwise_with_gw_hp, dW in high precision (fp8_rowwise.py);
    cp_group: under context parallelism (None at cp=1) each rank holds a slice of the tokens, so an amax over
    tokens (all of a tensorwise x or dy; rowwise's per-channel ones) is reduced over it too."""
    tp_group: object = None
    hardware: bool = False
    gathered: Fp8Weight | None = None
    rowwise: bool = False
    tp_split: str | None = None
    weight_grad_hp: bool = False
    cp_group: object = None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _apply(x, (self,), (weight, bias))[0]


def fp8_problem(device: torch.device, emulate: bool) -> str | None:
    """Why train.precision=fp8 cannot run on device (None: it can; emulated on CPU or when asked)."""
    if device.type != "cuda" or emulate:
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= MIN_CAPABILITY:
        return None
    return (f"train.precision=fp8: needs an NVIDIA GPU of compute capability >= 8.9 (L4/L40S, H100/H200 or newer) "
            f"for torch._scaled_mm, got {torch.cuda.get_device_name(device)} (sm_{major}{minor}); use "
            "train.precision=bf16, or train.fp8_emulate=true to emulate fp8 (slow, for checking numerics)")


def eager_fp8_warning(device: torch.device, emulate: bool, compile: bool) -> str | None:
    """The warning for fp8 on a GPU without train.compile (None otherwise): eager runs every amax and cast as
    kernels of their own (kernels/fp8_quant.py), which inductor fuses into the ops around them (docs/fp8.md)."""
    if device.type != "cuda" or emulate or compile:
        return None
    return ("warning: train.precision=fp8 without train.compile runs each amax and cast as a kernel of its own, "
            "where train.compile fuses them into the ops around them (docs/fp8.md, Speed); set train.compile=true")


def uses_hardware(device: torch.device, emulate: bool) -> bool:
    return device.type == "cuda" and not emulate and fp8_problem(device, emulate) is None


def apply_fp8(model: nn.Module, dims: ParallelDims, cfg: ModelConfig, emulate: bool,
              recipe: str = "tensorwise") -> list[str]:
    """Give the FP8_PLAN linears of model (after apply_tensor_parallel and apply_grad_accumulation_fusion)
    their Fp8Linear, in place, with recipe's scales (train.fp8_recipe: tensorwise, or rowwise and
    rowwise_with_gw_hp: fp8_rowwise.py).
    Raises ConfigError where the device cannot run fp8 (fp8_problem); the recipe rule (replicated kv heads) is
    parallel/mesh/rules.py's. LoRA's frozen base projections run in fp8, their adapters in the autocast dtype.
    Returns the names of the converted modules."""
    problem = fp8_problem(dims.device, emulate)
    if problem:
        raise ConfigError(problem)
    assert dims.tp == 1 or cfg.kv_heads % dims.tp == 0, \
        "apply_fp8: layout_problems refuses replicated kv heads under fp8"
    spec = Fp8Linear(tp_group=dims.tp_group if dims.tp > 1 else None, hardware=uses_hardware(dims.device, emulate),
                     cp_group=dims.cp_group if dims.cp > 1 else None,
                     rowwise=recipe != "tensorwise", weight_grad_hp=recipe == "rowwise_with_gw_hp")
    names = []
    for name, module in model.named_modules():
        if _LAYER_PREFIX.sub("", name) in FP8_PLAN:
            assert isinstance(module, WeightGradModule), f"apply_fp8: {name} is a {type(module).__name__}; " \
                "call apply_grad_accumulation_fusion first"
            split = "out" if isinstance(module, ColumnParallelLinear) else \
                "in" if isinstance(module, RowParallelLinear) else None
            module.fp8 = spec if split is None else dataclasses.replace(spec, tp_split=split)
            names.append(name)
    experts = Fp8Experts(tp_group=spec.tp_group, hardware=spec.hardware)  # one recipe (fp8_experts.py)
    for name, module in model.named_modules():
        if isinstance(module, Experts):
            module.fp8_grouped = experts
            names.append(name)
    for module in model.modules():  # linears of one input share its quantisation (fp8_linears)
        linears = [getattr(module, n, None) for n in getattr(module, "ONE_INPUT_LINEARS", ())]
        if linears and all(getattr(linear, "fp8", None) is not None for linear in linears):
            module.shared_input = fp8_linears
    return names
