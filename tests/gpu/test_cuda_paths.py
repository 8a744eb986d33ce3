"""The CUDA paths, on one GPU (`pytest -m gpu`, under 3 minutes; skipped without CUDA, tests/conftest.py):
compiled Triton kernels and torch.compile against the torch references, bf16 and fp8 training through
train.py, the fp8 scaled matmul against its emulation, train.compile, a training step that reads nothing to
the host before its update, and MoE's grouped GEMMs against the per-expert loop.
Triton runs compiled only in a process without TRITON_INTERPRET (tests/conftest.py sets it for the CPU
kernel tests), so the Triton and training cases run in subprocesses."""
import json
import os
import subprocess
import sys

import pytest
import torch

from pipetrain.parallel.tensor.fp8 import MIN_CAPABILITY, Fp8Linear, fp8_linears
from tests.e2e.common import ROOT, run_train, step_losses
from tests.unit.common import patch_torch_op

pytestmark = pytest.mark.gpu
GPU_STEPS = ["train.steps=12", "run.eval_every=0"]


def _fp8_capable() -> bool:
    return torch.cuda.get_device_capability() >= MIN_CAPABILITY


def _skip_without_fp8_hardware() -> None:
    """A card older than sm_89 has no torch._scaled_mm: the hardware-against-emulation tests cannot run there
    (the fp8 training test then checks the one-line refusal instead)."""
    if not _fp8_capable():
        pytest.skip(f"torch._scaled_mm needs compute capability >= 8.9, got {torch.cuda.get_device_capability()}")


def test_compiled_triton_kernels_and_torch_compile_match_the_references_on_cuda():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "kernels.py"), "--check"], env=env,
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("triton, eager and compile agree") == 5, proc.stdout


_BF16 = []  # the bf16 run's losses, run once for the module


@pytest.fixture
def bf16_on_cuda(tmp_path_factory):
    """Function-scoped (cached), so it runs after tests/conftest.py has given this gpu test the GPU back."""
    if not _BF16:
        out = str(tmp_path_factory.mktemp("bf16"))
        proc, metrics = run_train(out, ["train.precision=bf16", *GPU_STEPS], cuda=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "bf16 on cuda" in proc.stdout
        _BF16.extend(step_losses(metrics))
    return list(_BF16)


def test_bf16_training_on_cuda_learns(bf16_on_cuda):
    assert len(bf16_on_cuda) == 12 and bf16_on_cuda[-1] < 0.9 * bf16_on_cuda[0]


# fp8 as it is meant to run (with train.compile), with 2 microbatches a step (the weight cache, its compiled
# quantisation and column-major copies: fp8.Fp8WeightCache) and evaluations (compiled blocks under no_grad)
FP8_KEYS = ["train.precision=fp8", "train.compile=true", "parallel.microbatches=2", *GPU_STEPS, "run.eval_every=6"]


def test_fp8_training_on_cuda_follows_bf16_or_names_the_card_it_needs(tmp_path, bf16_on_cuda):
    proc, metrics = run_train(str(tmp_path / "fp8"), FP8_KEYS, cuda=True)
    if not _fp8_capable():
        assert proc.returncode == 2 and "compute capability >= 8.9" in proc.stderr, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
        proc, metrics = run_train(str(tmp_path / "emulated"), [*FP8_KEYS, "train.fp8_emulate=true"], cuda=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len([m for m in metrics if "eval_loss" in m]) == 2
    losses = step_losses(metrics)
    assert losses != bf16_on_cuda
    assert losses == pytest.approx(bf16_on_cuda, rel=2e-2)  # tests/e2e/test_fp8.py's FP8_CURVE


def test_fp8_eager_training_on_cuda_takes_the_triton_casts_and_follows_bf16(tmp_path, bf16_on_cuda):
    """Without train.compile each amax and cast is kernels/fp8_quant.py's Triton (compiled for this card)."""
    if not _fp8_capable():
        pytest.skip("fp8 needs compute capability >= 8.9 (the compiled run above checks the refusal)")
    keys = [k for k in FP8_KEYS if k != "train.compile=true"]
    proc, metrics = run_train(str(tmp_path / "fp8-eager"), keys, cuda=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "without train.compile runs each amax and cast as a kernel of its own" in proc.stderr  # eager it was
    assert step_losses(metrics) == pytest.approx(bf16_on_cuda, rel=2e-2)


_FP8_CASTS = """
import torch
from pipetrain.kernels import fp8_quant
from pipetrain.kernels.fp8_quant import fp8_cast, fp8_columns, fp8_max, quantize_ref, quantize_tensorwise
assert type(fp8_quant._cast_kernel).__name__ == "JITFunction", type(fp8_quant._cast_kernel)  # compiled, not interpreted
bits = lambda t: t.contiguous().view(torch.uint8)
def same(got, want, what, nan=False):
    for a, b in ((got[0], want[0]), (got[2], want[2])):
        if a is None:
            assert b is None, what
            continue
        assert a.t().is_contiguous() == b.t().is_contiguous(), what
        if nan:
            torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=0, equal_nan=True, msg=what)
        else:
            assert torch.equal(bits(a), bits(b)), what
    assert torch.equal(got[1], want[1]) or (got[1].isnan() and want[1].isnan()), (what, got[1], want[1])
torch.manual_seed(0)
for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
    values = torch.arange(256, dtype=torch.uint8).view(fmt).float()
    values = values[values.isfinite() & (values >= 0)].unique()
    mids = (values[1:] + values[:-1]) / 2  # ties, and a hair either side of each
    grid = torch.cat([values, mids, mids * (1 + 2**-20), mids * (1 - 2**-20), values[:1] + 2.0**-30])
    x = torch.cat([grid, -grid, torch.tensor([-0.0, fp8_max(fmt)])]).reshape(1, -1).cuda()
    same(quantize_tensorwise(x, fmt, columns=True), quantize_ref(x, fmt, columns=True), ("grid", fmt))
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((1000, 344), (3, 200), (130, 70)):
            x = (torch.randn(*shape, device="cuda") * 3).to(dtype)
            for rows, columns in ((True, False), (False, True), (True, True)):
                same(quantize_tensorwise(x, fmt, rows=rows, columns=columns),
                     quantize_ref(x, fmt, rows=rows, columns=columns), (fmt, dtype, shape, rows, columns))
            q = quantize_ref(x, fmt)[0]
            assert torch.equal(bits(fp8_columns(q)), bits(q)) and fp8_columns(q).t().is_contiguous()
    for name, x in {"zeros": torch.zeros(4, 8), "inf": torch.tensor([[1.0, float("inf"), -2.0]]),
                    "nan": torch.tensor([[1.0, float("nan"), -2.0]])}.items():
        same(quantize_tensorwise(x.cuda(), fmt), quantize_ref(x.cuda(), fmt), (name, fmt), nan=True)
    for k in (0, 3, 7):  # an amax an ulp above fp8_max / 2^k: the scale is 2^(k - 1)
        amax = torch.tensor([fp8_max(fmt) / 2**k]).nextafter(torch.tensor([float("inf")])).cuda()
        assert fp8_cast(torch.ones(1, 1, device="cuda"), amax, fmt)[1].item() == 2.0 ** (k - 1), (fmt, k)
print("the compiled float8 casts equal the reference bit for bit")
"""


def test_fp8_triton_casts_compiled_for_this_card_equal_the_torch_reference_bit_for_bit():
    """kernels/fp8_quant.py's kernels as eager fp8 runs them (compiled: a process without TRITON_INTERPRET)
    against the torch reference on the card: every float8 value of both formats, the ties between them, random
    fp32 and bf16 tensors in both layouts and the byte transpose, zeros, inf, NaN, and the scale's edge."""
    _skip_without_fp8_hardware()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _FP8_CASTS], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "the compiled float8 casts equal the reference bit for bit" in proc.stdout, proc.stdout


def test_fp8_bias_in_the_scaled_mm_epilogue_matches_the_emulation_under_bf16_autocast_on_cuda():
    """Under bf16 autocast a bias goes into torch._scaled_mm's epilogue (fp8.scaled_mm), where the emulation adds
    it before its rounding to bf16; within the bound of the test below (cuBLASLt may add it after rounding
    under some split-K algorithms: an ulp of bf16, inside that bound)."""
    _skip_without_fp8_hardware()
    torch.manual_seed(0)
    x = torch.randn(4, 32, 64, device="cuda") * 3
    w, b = torch.randn(48, 64, device="cuda"), torch.randn(48, device="cuda") * 5
    outs = []
    for hardware in (True, False):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outs.append(Fp8Linear(hardware=hardware)(x, w, b))
    assert outs[0].dtype == outs[1].dtype == torch.bfloat16
    torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=0.0,
                               atol=2 ** -7 * outs[1].float().abs().max().item())


def test_fp8_scaled_mm_matches_its_emulation_on_cuda():
    _skip_without_fp8_hardware()
    torch.manual_seed(0)
    grads = {}
    x = torch.randn(4, 16, 64, device="cuda")
    w = torch.randn(48, 64, device="cuda")
    g = torch.randn(4, 16, 48, device="cuda")
    for hardware in (True, False):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = Fp8Linear(hardware=hardware)(xi, wi)
        (y * g).sum().backward()
        grads[hardware] = (y.detach(), xi.grad, wi.grad)
    # The same fp8 products, summed differently: the emulation in fp32, the tensor cores keeping about 14 bits
    # while they accumulate (DeepSeek-V3 measured this on Hopper). Within one promotion interval (128 here or
    # more; the inner dimensions are 64, 48 and 64) that holds with or without fast accumulation, so each
    # product can be rounded at 2^-14 of a partial sum: at most K * 2^-14 = 2^-8 of the largest partial sum,
    # allowed here as 2^-7 of the largest value (a partial sum can exceed it). A wrong scale (a power of two)
    # or a transposed operand is far outside that.
    for got, want in zip(grads[True], grads[False]):
        bound = 2 ** -7 * want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=0.0, atol=bound)


def test_fp8_linears_of_one_input_match_their_emulation_on_cuda():
    """The shared input's path (fp8_linears: x quantised once, its column-major copy made once for the weight
    gradients) on torch._scaled_mm, against the emulation, within the bound of the test above."""
    _skip_without_fp8_hardware()
    torch.manual_seed(0)
    linears = [torch.nn.Linear(64, n, bias=bias, device="cuda") for n, bias in ((48, False), (32, True), (48, False))]
    x = torch.randn(4, 16, 64, device="cuda")
    results = {}
    for hardware in (True, False):
        for linear in linears:
            linear.zero_grad(set_to_none=True)
            linear.fp8 = Fp8Linear(hardware=hardware)
        xi = x.clone().requires_grad_()
        outs = fp8_linears(xi, tuple(linears))
        sum((out * out.detach()).sum() for out in outs).backward()
        results[hardware] = [*(out.detach() for out in outs), xi.grad,
                             *(linear.weight.grad for linear in linears), linears[1].bias.grad]
    for got, want in zip(results[True], results[False]):
        torch.testing.assert_close(got, want, rtol=0.0, atol=2 ** -6 * want.abs().max().item())


def test_fp8_rowwise_scaled_mm_matches_its_emulation_on_cuda(monkeypatch):
    """train.fp8_recipe=rowwise on torch._scaled_mm's rowwise kernel (scales (M, 1) and (1, N), bf16 results, a
    bias in its epilogue) under bf16 autocast, against the emulation: the three GEMMs take the hardware, and y,
    dx, dW and db agree within the bound of the tensorwise test above, with one more bf16 rounding (dW)."""
    _skip_without_fp8_hardware()
    calls = []
    real = torch._scaled_mm
    patch_torch_op(monkeypatch, "_scaled_mm", lambda *a, **k: calls.append(tuple(k["scale_a"].shape)) or real(*a, **k))
    torch.manual_seed(0)
    x = torch.randn(4, 16, 64, device="cuda") * 2.0 ** torch.randint(-4, 5, (4, 16, 1), device="cuda")
    w, b = torch.randn(48, 64, device="cuda"), torch.randn(48, device="cuda")
    g = torch.randn(4, 16, 48, device="cuda")
    results = {}
    for hardware in (True, False):
        xi, wi, bi = (t.clone().requires_grad_() for t in (x, w, b))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = Fp8Linear(hardware=hardware, rowwise=True)(xi, wi, bi)
        (y.float() * g).sum().backward()
        results[hardware] = (y.detach().float(), xi.grad, wi.grad, bi.grad)
    assert calls == [(64, 1), (64, 1), (48, 1)]  # y and dx: a scale per token; dW: per output channel
    for got, want in zip(results[True], results[False]):
        torch.testing.assert_close(got, want, rtol=0.0, atol=2 ** -6 * want.abs().max().item())


def test_train_compile_on_cuda_matches_eager(tmp_path, bf16_on_cuda):
    proc, metrics = run_train(str(tmp_path), ["train.precision=bf16", "train.compile=true", *GPU_STEPS], cuda=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert step_losses(metrics) == pytest.approx(bf16_on_cuda, rel=2e-2)  # bf16: fusion changes the rounding


_STEP_ON_DEVICE = """
import tempfile, torch
from pipetrain.parallel.mesh.dims import ParallelDims
from tests.unit.common import LLAMA, build_trainer
from tests.unit.test_step_on_device import _Ops, _float_reads_before_the_update
trainer = build_trainer(LLAMA, tempfile.mkdtemp(), ParallelDims(device=torch.device("cuda")), steps=3,
                        precision="bf16", grad_clip=0.5)
assert trainer.optimizer.steps_on_device, "CUDA parameters should get the fused AdamW"
trainer.train_step()
with _Ops() as mode:
    record = trainer.train_step()
print("float reads before the update:", _float_reads_before_the_update(mode.ops), record["loss"])

# With document masking (and under cp) every layer gets positions: CUDA's sync debug mode raises at any
# wait for the device (a read, or a blocking copy such as positions.to("cuda") from pageable memory) from
# the step's start until its update is queued.
next_batch = trainer.loader.next
def with_positions():
    batch, num_targets = next_batch()
    batch.positions = (torch.arange(batch.inputs.shape[1]) % 5).expand_as(batch.inputs).contiguous()
    return batch, num_targets
trainer.loader.next = with_positions
clip_and_step = trainer.optimizer.clip_and_step
def queued_then_allowed(*args):
    out = clip_and_step(*args)
    torch.cuda.set_sync_debug_mode(0)
    return out
trainer.optimizer.clip_and_step = queued_then_allowed
torch.cuda.set_sync_debug_mode("error")
trainer.train_step()
print("no wait for the device before the update, with positions")
"""


def test_a_training_step_on_cuda_reads_nothing_to_the_host_before_its_update():
    """The step on the device (tests/unit/test_step_on_device.py) as CUDA runs it: fused AdamW by default, the
    norm, clip and check queued without a read, so the GPU never drains mid-step."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _STEP_ON_DEVICE], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "float reads before the update: 0 " in proc.stdout, proc.stdout
    assert "no wait for the device before the update, with positions" in proc.stdout, proc.stdout


_GROUPED_MM = """
import torch
from pipetrain.models.moe import _grouped_mm_ok, grouped_swiglu, grouped_swiglu_loop
torch.manual_seed(0)
E, D, Fh = 4, 64, 128
counts = torch.tensor([40, 0, 56, 32], device="cuda")
leaves = [torch.randn(128, D), torch.randn(E, Fh, D), torch.randn(E, Fh, D), torch.randn(E, D, Fh)]
inputs = [t.to("cuda", torch.bfloat16) for t in leaves]
print("grouped:", _grouped_mm_ok(inputs[0], inputs[1]))
for name, loss in {"sum": lambda y: y.sum(), "square": lambda y: y.float().square().sum()}.items():
    results = []
    for grouped in (True, False):
        x, gate, up, down = [t.clone().requires_grad_() for t in inputs]
        y = (grouped_swiglu(x, counts, gate, up, down) if grouped
             else grouped_swiglu_loop(x, counts.tolist(), gate, up, down))
        loss(y).backward()
        results.append([y, x.grad, gate.grad, up.grad, down.grad])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item(), msg=name)
print("grouped GEMMs match the loop")
"""


def test_moe_grouped_gemm_on_cuda_matches_the_per_expert_loop_forward_and_backward():
    """torch._grouped_mm on sm90+ (the H100 crashed in its backward on a plain sum's stride-0 gradient before
    models/moe.py's _DenseGrad); an older card runs the loop on both sides, which still checks the wiring."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _GROUPED_MM], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    capable = torch.cuda.get_device_capability() >= (9, 0)
    assert f"grouped: {capable}" in proc.stdout and "grouped GEMMs match the loop" in proc.stdout, proc.stdout


_MOE_COMPILE = """
import json, tempfile, torch
from pipetrain.models.moe import _grouped_mm_ok
from pipetrain.parallel.mesh.dims import ParallelDims
from tests.unit.common import TINY_MOE as moe, build_trainer
losses = {}
for compile_ in (False, True):
    trainer = build_trainer(moe, tempfile.mkdtemp(), ParallelDims(device=torch.device("cuda")), steps=3,
                            precision="bf16", compile=compile_, learnable=True)
    losses[compile_] = [trainer.train_step()["loss"] for _ in range(3)]
x = torch.zeros(8, 32, device="cuda")
with torch.autocast("cuda", torch.bfloat16):
    print("grouped:", _grouped_mm_ok(x, torch.zeros(4, 24, 32, device="cuda")))
print("losses:", json.dumps([losses[False], losses[True]]))
"""


def test_compiled_experts_on_cuda_follow_eager():
    """A MoE's blocks under train.compile with inductor on the card: torch._grouped_mm traced into the graph on
    sm90+ (bf16 under autocast), else the op pipetrain::grouped_linear; three steps within bf16's tolerance of
    eager (CPU: tests/unit/test_compile.py, bit for bit under aot_eager)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _MOE_COMPILE], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    capable = torch.cuda.get_device_capability() >= (9, 0)
    assert f"grouped: {capable}" in proc.stdout, proc.stdout
    eager, compiled = json.loads(proc.stdout.split("losses:")[1])
    assert compiled == pytest.approx(eager, rel=2e-2), (compiled, eager)


def test_fp8_experts_scaled_grouped_mm_matches_its_emulation_on_cuda(monkeypatch):
    """The experts' float8 grouped GEMMs (parallel/tensor/fp8_experts.py) on torch._scaled_grouped_mm (sm90 and
    sm100) and dW on torch._grouped_mm, under bf16 autocast, against the emulation: y, dx and dW within the rowwise
    linear's bound (one more bf16 rounding apart). Expert row counts as routing makes them: an empty expert, and
    none a multiple of 8 (a dW operand in the wrong layout makes the kernel assert on those)."""
    from pipetrain.parallel.tensor import fp8_experts
    if not fp8_experts.scaled_grouped_mm_capable(torch.cuda.get_device_capability(), torch.version.hip is not None):
        pytest.skip("torch._scaled_grouped_mm runs on sm90 and sm100 only (the experts emulate elsewhere: "
                    "tests/unit/test_fp8_experts.py)")
    calls, real = [], torch._scaled_grouped_mm
    patch_torch_op(monkeypatch, "_scaled_grouped_mm", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    grouped, real_grouped = [], torch._grouped_mm
    patch_torch_op(monkeypatch, "_grouped_mm", lambda *a, **k: grouped.append(a[0].shape) or real_grouped(*a, **k))
    torch.manual_seed(0)
    offs = torch.cumsum(torch.tensor([5, 0, 17, 39], device="cuda"), 0)
    x, w = torch.randn(61, 64, device="cuda"), torch.randn(4, 48, 64, device="cuda")
    g = torch.randn(61, 48, device="cuda")
    results = {}
    for hardware in (True, False):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fp8_experts.Fp8Experts(hardware=hardware)(xi, wi, offs, "out")
        (y.float() * g).sum().backward()
        torch.cuda.synchronize()  # a device-side assert surfaces here
        results[hardware] = (y.detach().float(), xi.grad, wi.grad)
    assert calls == [(61, 64), (61, 48)]  # y and dx on the hardware
    assert grouped == [(48, 61), (48, 61)]  # dW (both runs: bf16's grouped GEMM either way)
    for got, want in zip(results[True], results[False]):
        torch.testing.assert_close(got, want, rtol=0.0, atol=2 ** -6 * want.abs().max().item())
