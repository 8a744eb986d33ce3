"""The experts' grouped GEMMs under train.precision=fp8 (pipetrain/parallel/tensor/fp8_experts.py): against an oracle
written here from the definition (a scale per token and per expert and channel, dW unquantised), under bf16
autocast, the hardware calls' layouts (checked by torch's meta kernels on the CPU), and a tiny MoE trained in
fp8 against bf16, with a deliberately broken scale. (tp=2 against tp=1: tests/dist/test_fp8.py.)"""

import pytest
import torch

from pipetrain.kernels.fp8_quant import quantize, scale_from_amax
from pipetrain.models.compile import BACKEND_ENV
from pipetrain.models.moe import MoE, grouped_linear_weight_grad
from pipetrain.parallel.tensor import fp8_experts
from pipetrain.parallel.tensor.fp8_experts import Fp8Experts, grouped_scaled_mm, grouped_weight_grad
from tests.unit.common import TINY_MOE, build_trainer, patch_torch_op

E4M3 = torch.float8_e4m3fn
MOE = TINY_MOE


def _dequantised(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t with a power-of-two scale per slice along dim (the amax over dim), quantised to e4m3 and back."""
    scale = scale_from_amax(t.abs().amax(dim=dim, keepdim=True), E4M3)
    return quantize(t, scale, E4M3).float() / scale


def _oracle(x, w, counts, dy):
    """Per expert g: y_g = x~_g W~_g^T (x~ per token, W~_g per output channel, both over K), dx_g = dy~_g W^_g
    (dy~ per token over N, W^_g per input channel over N), dW_g = dy_g^T x_g unquantised."""
    ys, dxs, dws, start = [], [], [], 0
    xq = _dequantised(x, 1)
    gq = _dequantised(dy, 1)
    for g, n in enumerate(counts):
        rows = slice(start, start + n)
        ys.append(xq[rows] @ _dequantised(w[g], 1).t())
        dxs.append(gq[rows] @ _dequantised(w[g], 0))
        dws.append(dy[rows].t() @ x[rows])
        start += n
    return torch.cat(ys), torch.cat(dxs), torch.stack(dws)


def _run(x, w, counts, dy, autocast=False):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        y = Fp8Experts()(x, w, torch.cumsum(torch.tensor(counts), 0), "out")
    y.backward(dy.to(y.dtype))
    return y, x.grad, w.grad


def _spread(shape):
    """randn of shape with every row and every column of the last two dims scaled by its own power of two, up to
    2^20 apart: wider than e4m3's normal range (2^-6 to 448), so a scale taken along the wrong dim sends other
    values into the subnormals or to zero (with power-of-two scales the choice changes nothing else)."""
    t = torch.randn(shape)
    return t * 2.0 ** torch.randint(-10, 11, (*shape[:-1], 1)) * 2.0 ** torch.randint(-10, 11, (*shape[:-2], 1,
                                                                                                 shape[-1]))


def _inputs(seed=0):
    torch.manual_seed(seed)
    counts = [3, 0, 5, 4]  # an empty expert
    x = _spread((12, 16))  # tokens and channels of different sizes
    w = _spread((4, 8, 16))
    return x, w, counts, _spread((12, 8))


def test_the_three_gemms_are_per_token_and_per_expert_channel_dequantised_matmuls():
    x, w, counts, dy = _inputs()
    y, dx, dw = _run(x, w, counts, dy)
    want_y, want_dx, want_dw = _oracle(x, w, counts, dy)
    torch.testing.assert_close(y, want_y, rtol=1e-6, atol=0)
    torch.testing.assert_close(dx, want_dx, rtol=1e-6, atol=0)
    torch.testing.assert_close(dw, want_dw, rtol=1e-6, atol=1e-6)
    assert dw[1].eq(0).all()  # the empty expert
    assert (y - torch.cat([x[:3] @ w[0].t(), x[3:8] @ w[2].t(), x[8:] @ w[3].t()])).abs().max() > 0  # quantised


def test_a_scale_per_expert_keeps_a_small_expert_that_one_scale_for_all_would_round_coarsely():
    """Why the experts take no tensorwise recipe: w's experts differ by up to 2^16, past e4m3's range of normal
    values (2^-6 to 448). Expert 0 (the smallest) quantised with the scale of the whole stack falls into the
    subnormals, and lands far further from its exact product than with a scale of its own."""
    torch.manual_seed(0)
    x, counts = torch.randn(12, 16), [3, 0, 5, 4]
    w = torch.randn(4, 8, 16) * 2.0 ** torch.tensor([-16.0, -4.0, -2.0, 0.0]).view(4, 1, 1)
    y, _, _ = _run(x, w, counts, torch.randn(12, 8))
    exact = x[:3] @ w[0].t()
    one_scale = scale_from_amax(w.abs().amax(), E4M3)
    shared = _dequantised(x[:3], 1) @ (quantize(w[0], one_scale, E4M3).float() / one_scale).t()
    assert (y[:3] - exact).abs().max() < (shared - exact).abs().max() / 8


def test_under_bf16_autocast_y_is_bf16_and_dw_a_bf16_gemm_cast_to_the_weights_dtype():
    x, w, counts, dy = _inputs()
    y, dx, dw = _run(x, w, counts, dy, autocast=True)
    assert (y.dtype, dx.dtype, dw.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    want_y, _, _ = _oracle(x, w, counts, dy)
    torch.testing.assert_close(y, want_y.bfloat16(), rtol=0, atol=0)  # one rounding of the fp32 sums
    dyb = dy.bfloat16()
    want_dw = grouped_linear_weight_grad(dyb, x.bfloat16(), torch.cumsum(torch.tensor(counts), 0), 4).float()
    torch.testing.assert_close(dw, want_dw, rtol=0, atol=0)


def test_scaled_grouped_mm_is_taken_on_sm90_and_sm100_only():
    """torch._scaled_grouped_mm raises on cards other than sm90 / sm100 (sm120 RTX Blackwell among them) and on
    ROCm: the experts emulate there."""
    assert [fp8_experts.scaled_grouped_mm_capable(c) for c in ((8, 9), (9, 0), (10, 0), (12, 0))] == [
        False, True, True, False]
    assert not fp8_experts.scaled_grouped_mm_capable((9, 4), rocm=True)


def test_the_hardware_calls_pass_torchs_meta_checks_and_dw_takes_the_unaligned_layout(monkeypatch):
    """torch._scaled_grouped_mm has no CPU kernel: its meta kernel (the shape, dtype and stride checks of the CUDA
    one: float8 row-major a, column-major b, scales (M,) and (E, N) fp32, 16-byte strides) runs on meta tensors,
    for y and for dx's transposed weight. What the CUDA kernel checks beyond them (each group's rows aligned along
    a summed dim) only a GPU shows: tests/gpu. torch._grouped_mm (dW's bf16 form) runs on the CPU: against the
    loop, with the operand layout that needs no such alignment."""
    monkeypatch.setattr(fp8_experts, "scaled_grouped_mm_ok", lambda *a: True)
    M, K, N, E = 64, 32, 48, 4
    offs = torch.tensor([16, 16, 48, 64], device="meta")
    a, a_scale = torch.empty(M, K, device="meta", dtype=E4M3), torch.empty(M, 1, device="meta")
    w = torch.empty(E, N, K, device="meta", dtype=E4M3)
    y = grouped_scaled_mm(a, a_scale, w, torch.empty(E, N, 1, device="meta"), offs, torch.bfloat16, True)
    assert (y.shape, y.dtype) == ((M, N), torch.bfloat16)
    g = torch.empty(M, N, device="meta", dtype=E4M3)
    w_in_scale = torch.empty(E, K, 1, device="meta")
    dx = grouped_scaled_mm(g, torch.empty(M, 1, device="meta"), w.transpose(-2, -1), w_in_scale, offs, torch.bfloat16,
                           True)
    assert (dx.shape, dx.dtype) == ((M, K), torch.bfloat16)
    monkeypatch.setattr(fp8_experts, "grouped_mm_weight_grad_ok", lambda *a: True)
    torch.manual_seed(0)
    dy, x = torch.randn(M, N).bfloat16(), torch.randn(M, K).bfloat16()
    cpu_offs = torch.tensor([13, 13, 42, 64])  # expert row counts that are no multiples of 8
    strides, real = [], torch._grouped_mm
    patch_torch_op(monkeypatch, "_grouped_mm", lambda a, b, **k: strides.append(a.stride()) or real(a, b, **k))
    got = grouped_weight_grad(dy, x, cpu_offs, E)
    # dy^T column-major, as torch's own backward hands it: a row-major one makes the CUDA kernel assert that
    # each group's rows along the summed dim are 16-byte aligned (13 rows of bf16 are not)
    assert strides == [(1, N)], strides
    want = grouped_linear_weight_grad(dy, x, cpu_offs, E)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7 * want.float().abs().max().item())


def test_a_moe_trained_in_fp8_follows_bf16(tmp_path, monkeypatch):
    """Emulated fp8 (the CPU) against bf16 on the tiny MoE: different, within 0.3% at every step (0.13% seen), and
    learning; every layer's experts run their six GEMMs a microbatch through the float8 grouped GEMM."""
    calls = []
    real = fp8_experts.grouped_scaled_mm
    monkeypatch.setattr(fp8_experts, "grouped_scaled_mm", lambda *a: calls.append(a[0].shape) or real(*a))
    losses = {}
    for precision in ("bf16", "fp8"):
        (tmp_path / precision).mkdir()
        trainer = build_trainer(MOE, str(tmp_path / precision), steps=6, microbatches=2, precision=precision,
                                learnable=True)
        experts = [m.fp8_grouped for m in trainer.model.modules() if hasattr(m, "fp8_grouped")]
        assert len(experts) == MOE.n_layers and all((e is not None) == (precision == "fp8") for e in experts)
        losses[precision] = [trainer.train_step()["loss"] for _ in range(6)]
    assert len(calls) == 6 * 2 * MOE.n_layers * 6, len(calls)  # steps x microbatches x layers x (3 y + 3 dx)
    fp8, bf16 = losses["fp8"], losses["bf16"]
    assert fp8 != bf16 and fp8 == pytest.approx(bf16, rel=3e-3) and fp8[-1] < 0.8 * fp8[0], (fp8, bf16)


@pytest.mark.parametrize("broken", [False, True])
def test_the_experts_output_is_within_e4m3s_error_of_bf16_and_a_broken_scale_is_not(monkeypatch, broken):
    """One MoE layer of trained-size weights, its output and input gradient under fp8 against bf16 autocast:
    within 8% in norm (e4m3 keeps 3 mantissa bits: about 2.6% RMS per value, so about 4% per product of two and
    6% through the SwiGLU's three GEMMs; 5.9% seen). With the experts' scales 16 times too large (every value above
    1/16 of its row's amax saturates): outside it (100% seen)."""
    if broken:
        monkeypatch.setattr(fp8_experts, "scale_from_amax", lambda amax, dtype: scale_from_amax(amax, dtype) * 16)
    torch.manual_seed(0)
    moe = MoE(MOE)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(2, 16, MOE.d_model)
    results = []
    for fp8 in (None, Fp8Experts()):
        moe.experts.fp8_grouped = fp8
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16):
            y = moe(xi)
        y.float().square().sum().backward()
        results.append((y.float(), xi.grad))
    (y16, dx16), (y8, dx8) = results
    errors = [((a - b).norm() / b.norm()).item() for a, b in ((y8, y16), (dx8, dx16))]
    assert all(e < 0.08 for e in errors) != broken, errors


def test_fp8_experts_inside_compiled_blocks_give_eager_fp8s_losses(tmp_path, monkeypatch):
    """train.compile with fp8 experts (aot_eager: inductor's trace, eager kernels): the first loss is eager fp8's
    bit for bit (and not bf16's), the later ones within 1e-3, as for fp8 linears (tests/unit/test_compile.py:
    the traced backward rounds a few gradients differently, which the float8 casts magnify)."""
    monkeypatch.setenv(BACKEND_ENV, "aot_eager")
    losses = {}
    for name, precision, compile_ in (("eager", "fp8", False), ("compiled", "fp8", True), ("bf16", "bf16", False)):
        torch._dynamo.reset()
        (tmp_path / name).mkdir()
        trainer = build_trainer(MOE, str(tmp_path / name), steps=3, microbatches=2, precision=precision,
                                compile=compile_)
        losses[name] = [trainer.train_step()["loss"] for _ in range(3)]
    eager, compiled = losses["eager"], losses["compiled"]
    assert compiled[0] == eager[0] != losses["bf16"][0] and compiled == pytest.approx(eager, rel=1e-3), losses
