"""The fp8 arithmetic of pipetrain/parallel/tensor/fp8.py against hand-computed values, and where fp8 is
refused. (Its training curve: tests/e2e/test_fp8.py; tp=2 against tp=1: tests/dist/test_fp8.py.)"""
import pytest
import torch
import torch.nn.functional as F

from pipetrain.config import ConfigError
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.tensor import fp8
from pipetrain.parallel.tensor.fp8 import (FORWARD_DTYPE, GRAD_DTYPE, Fp8Linear, fp8_problem, quantize,
                                           scale_from_amax, tensor_scale)
from tests.unit.common import GPT2, LLAMA, build_trainer, patch_torch_op, scaled_mm_takes_rowwise_scales_on_cpu

EXACT = dict(rtol=0.0, atol=0.0)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() / scale


def test_scale_is_the_largest_power_of_two_that_keeps_amax_in_range():
    # e4m3: 448 / 3 = 149.3 -> 128; e5m2: 57344 / 3 = 19114.7 -> 16384; 448 fits exactly; 449 needs 0.5
    assert scale_from_amax(torch.tensor(3.0), FORWARD_DTYPE).item() == 128.0
    assert scale_from_amax(torch.tensor(3.0), GRAD_DTYPE).item() == 16384.0
    assert scale_from_amax(torch.tensor(448.0), FORWARD_DTYPE).item() == 1.0
    assert scale_from_amax(torch.tensor(449.0), FORWARD_DTYPE).item() == 0.5
    assert torch.isfinite(scale_from_amax(torch.tensor(0.0), FORWARD_DTYPE))  # all zeros: zeros, not NaN


def test_e4m3_quantise_and_dequantise_match_hand_computed_values():
    x = torch.tensor([1.0, -3.0, 0.1, 0.0])
    scale = tensor_scale(x, FORWARD_DTYPE)
    assert scale.item() == 128.0
    q = quantize(x, scale, FORWARD_DTYPE)
    assert q.dtype == torch.float8_e4m3fn
    # 0.1 * 128 = 12.8: e4m3 steps by 1 in [8, 16), so 13; -384 = -1.5 * 2^8 is exact
    torch.testing.assert_close(q.float(), torch.tensor([128.0, -384.0, 13.0, 0.0]), **EXACT)
    torch.testing.assert_close(dequantize(q, scale), torch.tensor([1.0, -3.0, 0.1015625, 0.0]), **EXACT)


def test_e5m2_gradient_quantisation_matches_hand_computed_values():
    g = torch.tensor([0.1, -3.0, 1e-10])
    scale = tensor_scale(g, GRAD_DTYPE)  # 16384
    q = quantize(g, scale, GRAD_DTYPE)
    # 0.1 * 16384 = 1638.4: e5m2 steps by 256 in [1024, 2048), so 1536; 1e-10 * 16384 = 1.6e-6 is below half the
    # smallest subnormal (2^-16), so 0
    torch.testing.assert_close(q.float(), torch.tensor([1536.0, -49152.0, 0.0]), **EXACT)
    torch.testing.assert_close(dequantize(q, scale), torch.tensor([0.09375, -3.0, 0.0]), **EXACT)


def test_quantise_saturates_instead_of_producing_nan():
    big = torch.tensor([1000.0, -1e6])
    torch.testing.assert_close(quantize(big, torch.tensor(1.0), FORWARD_DTYPE).float(),
                               torch.tensor([448.0, -448.0]), **EXACT)
    torch.testing.assert_close(quantize(big * 1e3, torch.tensor(1.0), GRAD_DTYPE).float(),
                               torch.tensor([57344.0, -57344.0]), **EXACT)


def _q(t, dtype):
    """t as the fp8 linear sees it: quantised with its own tensorwise scale, then dequantised (fp32)."""
    scale = tensor_scale(t, dtype)
    return dequantize(quantize(t, scale, dtype), scale)


def test_fp8_linear_forward_and_backward_are_the_dequantised_matmuls():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    g = torch.randn(3, 5, 8)
    y = Fp8Linear()(x, w, b)
    (y * g).sum().backward()
    xq, wq, gq = _q(x.detach(), FORWARD_DTYPE), _q(w.detach(), FORWARD_DTYPE), _q(g, GRAD_DTYPE)
    torch.testing.assert_close(y, xq @ wq.t() + b.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, gq @ wq, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, gq.reshape(-1, 8).t() @ xq.reshape(-1, 16), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(b.grad, g.sum((0, 1)), rtol=1e-6, atol=1e-6)
    assert not torch.equal(y, torch.nn.functional.linear(x, w, b))  # it did quantise


def test_fp8_linear_under_bf16_autocast_returns_bf16_and_fp32_weight_grads():
    torch.manual_seed(0)
    x = torch.randn(4, 16, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = Fp8Linear()(x, w)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert w.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


def test_the_bias_is_added_before_the_one_rounding_to_bf16_on_both_paths():
    """Under bf16 autocast the bias joins the fp32 product before its rounding to bf16: in torch._scaled_mm's
    epilogue on the hardware path (no pass of its own over y), and so in the emulation; adding it after the
    rounding (as a separate op would) rounds twice, which these values show."""
    torch.manual_seed(0)
    x, w, b = torch.randn(32, 64) * 3, torch.randn(48, 64) * 0.3, torch.randn(48) * 5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ys = [Fp8Linear(hardware=hardware)(x, w, b) for hardware in (True, False)]
    xq, wq = _q(x, FORWARD_DTYPE), _q(w, FORWARD_DTYPE)
    once = (xq @ wq.t() + b.to(torch.bfloat16).float()).to(torch.bfloat16)
    twice = (xq @ wq.t()).to(torch.bfloat16) + b.to(torch.bfloat16)
    assert not torch.equal(once, twice)
    for y in ys:
        assert y.dtype == torch.bfloat16 and torch.equal(y, once)


def _train_linear(hardware: bool, shape=(4, 16, 64), d_out=48):
    torch.manual_seed(0)
    x = (torch.randn(*shape) * 3).requires_grad_()
    w = (torch.randn(d_out, shape[-1]) * 0.02).requires_grad_()
    g = torch.randn(*shape[:-1], d_out) * 1e-3
    y = Fp8Linear(hardware=hardware)(x, w)
    (y * g).sum().backward()
    return y.detach(), x.grad, w.grad


def test_the_scaled_mm_path_matches_the_emulation_on_cpu():
    # torch._scaled_mm also runs on the CPU (torch 2.11 and 2.13), so the hardware path's operand layouts
    # and scales are checked here, not only on a GPU; only the summation order may differ
    for got, want in zip(_train_linear(hardware=True), _train_linear(hardware=False)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


def test_only_the_forward_gemm_takes_fast_accumulation(monkeypatch):
    calls = []
    real = torch._scaled_mm

    def recording(a, b, **kwargs):
        calls.append((a.dtype, b.dtype, a.is_contiguous(), b.t().is_contiguous(), kwargs.get("use_fast_accum")))
        return real(a, b, **kwargs)

    patch_torch_op(monkeypatch, "_scaled_mm", recording)
    _train_linear(hardware=True)
    e4, e5 = FORWARD_DTYPE, GRAD_DTYPE
    # y = xq Wq^T (fast, torchao's choice for the output), dx = gq Wq, dW = gq^T xq (full accumulation);
    # a row-major, b column-major, as cuBLASLt's fp8 GEMM needs
    assert calls == [(e4, e4, True, True, True), (e5, e4, True, True, False), (e5, e4, True, True, False)]
    calls.clear()
    _train_linear(hardware=True, shape=(3, 5, 24), d_out=8)  # not multiples of 16: the emulation, no call
    assert calls == []


def test_a_gpu_older_than_sm89_is_refused_in_one_line_unless_emulation_is_asked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    cuda = torch.device("cuda", 0)
    problem = fp8_problem(cuda, emulate=False)
    assert "compute capability >= 8.9" in problem and "A100" in problem and "sm_80" in problem
    assert "train.fp8_emulate=true" in problem and "\n" not in problem
    assert fp8_problem(cuda, emulate=True) is None
    assert fp8_problem(torch.device("cpu"), emulate=False) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8_problem(cuda, emulate=False) is None and fp8.uses_hardware(cuda, emulate=False)
    assert not fp8.uses_hardware(cuda, emulate=True)


def test_build_refuses_fp8_on_an_old_gpu_with_a_config_error(monkeypatch, tmp_path):
    monkeypatch.setattr(fp8, "fp8_problem", lambda device, emulate: "train.precision=fp8: needs sm_89")
    with pytest.raises(ConfigError, match="needs sm_89"):  # the CLI prints it as one line and exits 2
        build_trainer(LLAMA, str(tmp_path), precision="fp8")


def test_fp8_on_a_gpu_without_compile_is_warned_about_in_one_line(monkeypatch, tmp_path, capsys):
    cuda = torch.device("cuda", 0)
    warning = fp8.eager_fp8_warning(cuda, emulate=False, compile=False)
    assert "train.compile=true" in warning and "fuses" in warning and "\n" not in warning
    # compiled, emulated or on the CPU: nothing to warn about
    assert fp8.eager_fp8_warning(cuda, emulate=False, compile=True) is None
    assert fp8.eager_fp8_warning(cuda, emulate=True, compile=False) is None
    assert fp8.eager_fp8_warning(torch.device("cpu"), emulate=False, compile=False) is None
    import pipetrain.build as build_module  # build prints what the rule says, once, on rank 0
    seen = []
    monkeypatch.setattr(build_module, "eager_fp8_warning",
                        lambda device, emulate, compile: seen.append(compile) or "warning: fp8 eager")
    build_trainer(LLAMA, str(tmp_path), ParallelDims(), precision="fp8")
    assert seen == [False] and capsys.readouterr().err.count("warning: fp8 eager") == 1


def test_fp8_converts_the_block_linears_and_leaves_embedding_head_and_norms(tmp_path):
    trainer = build_trainer(LLAMA, str(tmp_path), ParallelDims(), precision="fp8")
    converted = sorted(n for n, m in trainer.model.named_modules() if getattr(m, "fp8", None) is not None)
    assert converted == sorted(f"layers.{i}.{name}" for i in range(LLAMA.n_layers) for name in fp8.FP8_PLAN)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # fp32 master weights


@pytest.mark.parametrize("cfg", [LLAMA, pytest.param(GPT2, marks=pytest.mark.slow)], ids=["llama", "gpt2"])
def test_the_scaled_mm_path_trains_like_the_emulation_eager_and_in_compiled_blocks(tmp_path, monkeypatch, cfg):
    """The hardware path forced on the CPU, where torch._scaled_mm runs too: every block linear's three GEMMs
    take it and the run equals the emulated one (the CPU's _scaled_mm sums as the emulation does); compiled
    blocks (one graph) take it too. gpt2: biases, in _scaled_mm's epilogue under the bf16 autocast."""
    from torch._dynamo.utils import counters

    from pipetrain.models.compile import BACKEND_ENV
    real = torch._scaled_mm

    def losses(name, hardware, **keys):
        monkeypatch.setattr(fp8, "uses_hardware", lambda device, emulate: hardware)
        (tmp_path / name).mkdir()
        trainer = build_trainer(cfg, str(tmp_path / name), steps=3, microbatches=2, precision="fp8", **keys)
        linears = [m for m in trainer.model.modules() if getattr(m, "fp8", None) is not None]
        shapes.update(tuple(m.weight.shape) for m in linears)
        count[0] = len(linears)
        return [trainer.train_step()["loss"] for _ in range(3)]

    calls, shapes, count = [], set(), [0]
    patch_torch_op(monkeypatch, "_scaled_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    emulated = losses("emulated", False)
    assert calls == []
    hardware = losses("hardware", True)
    assert count[0] == cfg.n_layers * (7 if cfg is LLAMA else 6)  # gpt2's MLP: up, down
    assert len(calls) == 3 * count[0] * 2 * 3  # 3 GEMMs a linear, 2 microbatches, 3 steps
    assert hardware == pytest.approx(emulated, rel=1e-5)
    # a traced graph cannot count calls (a side effect), so the marker is a _scaled_mm whose results are halved:
    # the compiled run follows the eager run that halves them, not the plain hardware run
    patch_torch_op(monkeypatch, "_scaled_mm", lambda *a, **k: real(*a, **k) * 0.5)
    marked = losses("marked", True)
    assert marked[0] != hardware[0]
    monkeypatch.setenv(BACKEND_ENV, "aot_eager")
    torch._dynamo.reset()  # (a compiled quantisation of these weight shapes from an earlier test would be reused)
    counters.clear()
    compiled = losses("compiled", True, compile=True)
    # the blocks' one graph, and the fp8 weight cache's quantisation (2 microbatches), one per weight shape
    assert counters["stats"]["unique_graphs"] == 1 + len(shapes), dict(counters["stats"])
    assert compiled[0] == marked[0] and compiled == pytest.approx(marked, rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_inductor_compiles_the_scaled_mm_path_to_eager_values(rowwise):
    """Inductor (not only aot_eager) with the hardware path: its fused amax / scale / cast kernels and the
    _scaled_mm extern call (with a bias, under bf16 autocast) give eager's output and gradients (about 10 s of
    compiling on 2 cores). rowwise: _scaled_mm with a scale per row (torch 2.13's CPU takes them; 2.11's not)."""
    if rowwise and not scaled_mm_takes_rowwise_scales_on_cpu():
        pytest.skip("this torch's CPU _scaled_mm takes tensorwise scales only (2.13's takes rowwise)")
    torch.manual_seed(0)
    spec = Fp8Linear(hardware=True, rowwise=rowwise)
    w1 = torch.nn.Parameter(torch.randn(48, 64) * 0.02)
    w2 = torch.nn.Parameter(torch.randn(64, 48) * 0.02)
    b1 = torch.nn.Parameter(torch.randn(48))  # under bf16 autocast: in _scaled_mm's epilogue
    x = torch.randn(4, 16, 64) * 3

    def run(fn):
        w1.grad = w2.grad = b1.grad = None
        xi = x.clone().requires_grad_()
        y = fn(xi)
        y.float().square().sum().backward()
        return y.detach(), xi.grad, w1.grad.clone(), w2.grad.clone(), b1.grad.clone()

    def forward(xi):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return spec(torch.relu(spec(xi, w1, b1)), w2)

    eager = run(forward)
    compiled = run(torch.compile(forward, backend="inductor", fullgraph=True))
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = F.linear(torch.relu(F.linear(x, w1, b1)), w2).detach()
    assert eager[0].dtype == bf16.dtype and not torch.equal(eager[0], bf16)  # it did quantise


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_evaluation_under_no_grad_computes_the_training_forward_bit_for_bit(tmp_path, recipe):
    """Under no_grad (evaluation, sampling) the fp8 linears run without their autograd Function (fp8._apply):
    the same quantisation and GEMMs, so the logits equal the training forward's on the same weights."""
    trainer = build_trainer(LLAMA, str(tmp_path), precision="fp8", fp8_recipe=recipe, steps=2)
    trainer.train_step()
    ids = torch.arange(16).reshape(1, 16) % LLAMA.vocab_size
    with torch.autocast("cpu", torch.bfloat16):
        with torch.no_grad():
            evaluated = trainer.model(ids)
        trained = trainer.model(ids)
    assert trained.requires_grad and not evaluated.requires_grad
    assert torch.equal(evaluated, trained.detach())
