"""train.fp8_recipe=rowwise (pipetrain/parallel/tensor/fp8_rowwise.py): a scale per row of each GEMM operand along
its summed dimension, checked against hand-computed values and an oracle written here from the definition; what
it keeps that tensorwise loses; the hardware path on the CPU; training; where it is refused. The same for
rowwise_with_gw_hp (dx's weight with one scale, dW in high precision). (tp=2 against tp=1: tests/dist/test_fp8.py;
the tiny recipe's curve: tests/e2e/test_fp8.py.)"""
import contextlib

import pytest
import torch

from pipetrain import build
from pipetrain.config import ParallelConfig, Recipe, TrainConfig
from pipetrain.kernels.fp8_quant import scale_from_amax
from pipetrain.parallel.mesh.rules import parallel_problems
from pipetrain.parallel.tensor.fp8 import Fp8Linear
from pipetrain.parallel.tensor.fp8_rowwise import ROWWISE_DTYPE, quantize_along
from tests.unit.common import LLAMA, build_trainer, patch_torch_op, scaled_mm_takes_rowwise_scales_on_cpu

EXACT = dict(rtol=0.0, atol=0.0)
E4M3_MAX = 448.0


def test_each_row_or_column_gets_the_power_of_two_scale_of_its_own_amax():
    t = torch.tensor([[1.0, -3.0], [0.001, 0.002]])
    q, scale = quantize_along(t, 1)  # per row: amax 3 -> 448 / 3 = 149.3 -> 128; 0.002 -> 224000 -> 2^17
    torch.testing.assert_close(scale, torch.tensor([[128.0], [2.0 ** 17]]), **EXACT)
    # 0.001 * 2^17 = 131.072: e4m3 steps by 16 in [128, 256), so 128; 0.002 * 2^17 = 262.144 steps by 32: 256
    torch.testing.assert_close(q.float(), torch.tensor([[128.0, -384.0], [128.0, 256.0]]), **EXACT)
    q, scale = quantize_along(t, 0)  # per column: amaxes 1 and 3 -> 256 and 128
    torch.testing.assert_close(scale, torch.tensor([[256.0, 128.0]]), **EXACT)
    # 0.001 * 256 = 0.256: e4m3 steps by 2^-5 in [0.25, 0.5), so 0.25; 0.002 * 128 the same value
    torch.testing.assert_close(q.float(), torch.tensor([[256.0, -384.0], [0.25, 0.25]]), **EXACT)
    assert q.dtype == ROWWISE_DTYPE
    _, scale = quantize_along(torch.zeros(2, 3), 1)
    assert torch.isfinite(scale).all()  # an all-zero row: zeros, not NaN


def _q(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The oracle: t quantised to e4m3 with a scale per row (dim 1) or column (dim 0), written from the
    definition (2^floor(log2(448 / amax)), clamp, round), then dequantised in fp64."""
    amax = t.detach().double().abs().amax(dim=dim, keepdim=True)
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))
    return (t.detach().double() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(ROWWISE_DTYPE).double() / scale


def _q_tensor(t: torch.Tensor) -> torch.Tensor:
    """The oracle of one scale for the whole tensor (rowwise_with_gw_hp's W in dx), as _q."""
    amax = t.detach().double().abs().max()
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))
    return (t.detach().double() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(ROWWISE_DTYPE).double() / scale


def _spread(*shape):
    """Rows and columns a few binades apart (else a power-of-two scale changes no rounding)."""
    binades = torch.randint(-6, 7, (*shape[:-1], 1)) + torch.randint(-6, 7, shape[-1:])
    return torch.randn(*shape) * 2.0 ** binades


def _check(got, want):  # fp32 sums against fp64: round-off of the largest terms
    torch.testing.assert_close(got.double().reshape(want.shape), want, rtol=1e-5, atol=1e-6 * want.abs().max())


def _linear(spec, x, w, b, g):
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = spec(x, w, b)
    (y * g).sum().backward()
    return y, x.grad, w.grad, b.grad


def test_the_rowwise_linear_is_the_three_matmuls_of_per_row_and_per_column_dequantised_operands():
    torch.manual_seed(0)
    x, w, b, g = _spread(3, 5, 32), _spread(16, 32), torch.randn(16), _spread(3, 5, 16)
    y, dx, dw, db = _linear(Fp8Linear(rowwise=True), x, w, b, g)
    x2, g2 = x.reshape(-1, 32), g.reshape(-1, 16)
    # y = x W^T: x per token, W per output channel; dx = dy W: dy per token, W per input channel;
    # dW = dy^T x: dy per output channel, x per input channel (each along the summed dimension)
    _check(y, _q(x2, 1) @ _q(w, 1).t() + b.double())
    _check(dx, _q(g2, 1) @ _q(w, 0))
    _check(dw, _q(g2, 0).t() @ _q(x2, 0))
    _check(db, g2.double().sum(0))
    tensorwise = _linear(Fp8Linear(), x, w, b, g)
    assert all(not torch.equal(a, t) for a, t in zip((y, dx, dw), tensorwise))  # another quantisation


def test_rowwise_with_gw_hp_is_rowwise_y_dx_with_one_weight_scale_and_an_unquantised_dw():
    """torchao's rowwise_with_gw_hp: y as rowwise; dx = dy W with dy per token and W under one scale; dW = dy^T x
    from the unquantised operands (here fp32: the exact product, to round-off)."""
    torch.manual_seed(0)
    x, w, b, g = _spread(3, 5, 32), _spread(16, 32), torch.randn(16), _spread(3, 5, 16)
    y, dx, dw, db = _linear(Fp8Linear(rowwise=True, weight_grad_hp=True), x, w, b, g)
    x2, g2 = x.reshape(-1, 32), g.reshape(-1, 16)
    _check(y, _q(x2, 1) @ _q(w, 1).t() + b.double())
    _check(dx, _q(g2, 1) @ _q_tensor(w))
    _check(dw, g2.double().t() @ x2.double())
    _check(db, g2.double().sum(0))
    rowwise = _linear(Fp8Linear(rowwise=True), x, w, b, g)
    assert torch.equal(y, rowwise[0]) and not torch.equal(dx, rowwise[1]) and not torch.equal(dw, rowwise[2])


def test_rowwise_keeps_the_small_rows_that_one_outlier_pushes_into_the_subnormals_under_tensorwise():
    """One token 2^16 times larger than the rest: under one scale per tensor the others keep about 2^-16 of
    e4m3's range (its subnormals: a bit or two of mantissa); per token each keeps three mantissa bits."""
    torch.manual_seed(0)
    x, w, b = torch.randn(16, 32), torch.randn(16, 32), torch.zeros(16)
    x[0] *= 2.0 ** 16
    exact = x.double() @ w.double().t()

    def small_rows_error(spec):
        y = spec(x, w, b).double()
        return ((y[1:] - exact[1:]).norm() / exact[1:].norm()).item()
    rowwise, tensorwise = small_rows_error(Fp8Linear(rowwise=True)), small_rows_error(Fp8Linear())
    assert rowwise < 0.1 < tensorwise, (rowwise, tensorwise)


def test_under_bf16_autocast_the_three_gemms_round_to_bf16_and_dw_is_cast_to_the_weights_dtype():
    torch.manual_seed(0)
    x, w, b = torch.randn(8, 32), torch.randn(16, 32), torch.randn(16)
    g = torch.randn(8, 16).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, dx, dw, db = _linear(Fp8Linear(rowwise=True), x, w, b, g)
    assert (y.dtype, dx.dtype, dw.dtype, db.dtype) == (torch.bfloat16, torch.float32, torch.float32, torch.float32)
    # dW came out of a bf16 GEMM (torch._scaled_mm's rowwise kernel writes bf16 only): bf16 values in fp32
    assert torch.equal(dw, dw.bfloat16().float()) and torch.equal(dx, dx.bfloat16().float())
    assert torch.equal(db, g.sum(0, dtype=torch.float32))  # the bias gradient sums the bf16 dy in fp32
    torch.testing.assert_close(dw.double(), _q(g.float(), 0).t() @ _q(x, 0), rtol=1e-2, atol=1e-2)


def test_under_bf16_autocast_gw_hp_takes_dw_from_a_bf16_gemm_of_bf16_dy_and_x_closer_than_rowwise():
    torch.manual_seed(0)
    x, w, b = _spread(64, 32), torch.randn(16, 32), torch.randn(16)
    g = _spread(64, 16).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, dx, dw, db = _linear(Fp8Linear(rowwise=True, weight_grad_hp=True), x, w, b, g)
        rowwise_dw = _linear(Fp8Linear(rowwise=True), x, w, b, g)[2]
    assert (y.dtype, dx.dtype, dw.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    assert torch.equal(dw, torch.mm(g.t(), x.bfloat16()).float())  # x saved in bf16, the GEMM's result in bf16
    exact = g.double().t() @ x.double()

    def error(got):
        return ((got.double() - exact).norm() / exact.norm()).item()
    assert error(dw) < 0.2 * error(rowwise_dw), (error(dw), error(rowwise_dw))  # 8 mantissa bits against 3


@pytest.mark.skipif(not scaled_mm_takes_rowwise_scales_on_cpu(),
                    reason="this torch's CPU _scaled_mm takes tensorwise scales only (2.13's takes rowwise)")
def test_the_hardware_path_takes_rowwise_scales_in_scaled_mm_and_matches_the_emulation(monkeypatch):
    calls = []
    real = torch._scaled_mm

    def recording(a, b, **kwargs):
        calls.append((a.dtype, b.dtype, a.is_contiguous(), b.t().is_contiguous(), tuple(kwargs["scale_a"].shape),
                      tuple(kwargs["scale_b"].shape), kwargs["out_dtype"], kwargs.get("use_fast_accum")))
        return real(a, b, **kwargs)

    torch.manual_seed(0)
    x, w, b = torch.randn(2, 16, 64), torch.randn(32, 64), torch.randn(32)
    g = torch.randn(2, 16, 32).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        emulated = _linear(Fp8Linear(rowwise=True), x, w, b, g)
        patch_torch_op(monkeypatch, "_scaled_mm", recording)
        hardware = _linear(Fp8Linear(rowwise=True, hardware=True), x, w, b, g)
    e4, bf = ROWWISE_DTYPE, torch.bfloat16
    # y (32 tokens x 32): scales (32, 1) and (1, 32); dx (32 x 64): (32, 1), (1, 64); dW (32 x 64): (32, 1), (1, 64)
    assert calls == [(e4, e4, True, True, (32, 1), (1, 32), bf, True),
                     (e4, e4, True, True, (32, 1), (1, 64), bf, False),
                     (e4, e4, True, True, (32, 1), (1, 64), bf, False)]
    for got, want in zip(hardware, emulated):
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * want.abs().max().item())
    calls.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _linear(Fp8Linear(rowwise=True, hardware=True), x, w, b, g.float())
    assert len(calls) == 3
    calls.clear()
    _linear(Fp8Linear(rowwise=True, hardware=True), x, w, b, g.float())  # fp32 results: its kernel writes bf16 only
    assert calls == []
    with torch.autocast("cpu", dtype=torch.bfloat16):  # rowwise_with_gw_hp: y and dx only, dW is a bf16 GEMM
        emulated = _linear(Fp8Linear(rowwise=True, weight_grad_hp=True), x, w, b, g)
        hardware = _linear(Fp8Linear(rowwise=True, weight_grad_hp=True, hardware=True), x, w, b, g)
    assert calls == [(e4, e4, True, True, (32, 1), (1, 32), bf, True),
                     (e4, e4, True, True, (32, 1), (1, 64), bf, False)]
    for got, want in zip(hardware, emulated):
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * want.abs().max().item())


def test_a_trainer_with_rowwise_fp8_learns_and_differs_from_tensorwise(tmp_path):
    def losses(recipe):
        (tmp_path / recipe).mkdir()
        trainer = build_trainer(LLAMA, str(tmp_path / recipe), steps=4, microbatches=2, learnable=True,
                                precision="fp8", fp8_recipe=recipe)
        specs = [m.fp8 for m in trainer.model.modules() if getattr(m, "fp8", None) is not None]
        assert len(specs) == 7 * LLAMA.n_layers
        assert all((s.rowwise, s.weight_grad_hp) == (recipe != "tensorwise", recipe == "rowwise_with_gw_hp")
                   for s in specs)
        cached = trainer.executor.around_run is not contextlib.nullcontext  # the tensorwise weight cache
        assert cached == (recipe == "tensorwise")
        return [trainer.train_step()["loss"] for _ in range(4)]

    tensorwise, rowwise, gw_hp = (losses(r) for r in ("tensorwise", "rowwise", "rowwise_with_gw_hp"))
    assert rowwise != tensorwise and gw_hp != rowwise and gw_hp != tensorwise
    assert rowwise == pytest.approx(tensorwise, rel=2e-2) and gw_hp == pytest.approx(rowwise, rel=2e-2)
    assert rowwise[-1] < 0.9 * rowwise[0] and gw_hp[-1] < 0.9 * gw_hp[0]


def test_rowwise_recipes_pass_the_rules_with_zero3_and_keep_the_weight_cache_off():
    """ZeRO-3 gathers rowwise weights in fp32 (tests/dist/test_zero3_fp8.py); the once-a-run cache holds one
    tensorwise quantisation of each weight, so only tensorwise takes it."""
    def recipe(name, **parallel):
        return Recipe(train=TrainConfig(precision="fp8", fp8_recipe=name), parallel=ParallelConfig(**parallel))
    for name in ("rowwise", "rowwise_with_gw_hp"):
        assert parallel_problems(recipe(name, zero=3)) == []
        assert not build.fp8_weights_once_a_run(recipe(name, microbatches=2))
    assert build.fp8_weights_once_a_run(recipe("tensorwise", microbatches=2))
    assert scale_from_amax(torch.tensor([3.0]), ROWWISE_DTYPE).item() == 128.0  # gradients in e4m3 too
