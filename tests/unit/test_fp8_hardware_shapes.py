"""The fp8 hardware path. fp8_gemm.scaled_mm takes torch._scaled_mm only where every dim (M, K and N) is
a multiple of 16, what its kernels need on a GPU, and other shapes fall back to the emulation: test_fp8.py tries
15 rows only, a shape that every weaker rule (multiples of 8, M and K alone) emulates too. It adds the bias
for an fp32 result too. And fp8.fp8_problem takes compute capability 8.9 (L4, L40S) itself, where test_fp8.py tries 8.0
and 9.0 only."""
import pytest
import torch

from pipetrain.parallel.tensor import fp8
from pipetrain.parallel.tensor.fp8_gemm import scaled_mm
from tests.unit.common import patch_torch_op, scaled_mm_takes_rowwise_scales_on_cpu

E4M3 = torch.float8_e4m3fn


def _calls(monkeypatch, m, k, n, rowwise=False):
    if rowwise and not scaled_mm_takes_rowwise_scales_on_cpu():
        pytest.skip("this torch's CPU _scaled_mm takes tensorwise scales only (2.13's takes rowwise)")
    calls = []
    real = torch._scaled_mm

    def recording(a, b, **kwargs):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return real(a, b, **kwargs)

    patch_torch_op(monkeypatch, "_scaled_mm", recording)
    torch.manual_seed(0)
    a, b = torch.randn(m, k).to(E4M3), torch.randn(k, n).to(E4M3)
    if rowwise:
        a_scale, b_scale = torch.full((m, 1), 2.0), torch.full((1, n), 4.0)
    else:
        a_scale, b_scale = torch.tensor(2.0), torch.tensor(4.0)
    y = scaled_mm(a, a_scale, b, b_scale, torch.bfloat16, hardware=True)
    want = (a.float() @ b.float()) / 8.0
    torch.testing.assert_close(y.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    return calls


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_every_dim_a_multiple_of_16_takes_scaled_mm(monkeypatch, rowwise):
    assert _calls(monkeypatch, 32, 48, 16, rowwise) == [((32, 48), (48, 16))]


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("m, k, n", [(24, 32, 16), (32, 24, 16), (32, 32, 8), (32, 32, 24)],
                         ids=["M-24", "K-24", "N-8", "N-24"])
def test_a_dim_that_is_a_multiple_of_8_but_not_16_is_emulated(monkeypatch, m, k, n, rowwise):
    assert _calls(monkeypatch, m, k, n, rowwise) == []


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_the_bias_is_added_on_the_hardware_path_for_every_result_dtype(out_dtype):
    """On the hardware path a bf16 / fp16 result takes the bias in _scaled_mm's epilogue, and an fp32 one after
    it: the emulation's y + bias either way (test_fp8.py checks the bf16 case only)."""
    torch.manual_seed(0)
    a, b = torch.randn(32, 32).to(E4M3), torch.randn(32, 16).to(E4M3)
    bias = (torch.randn(16) * 100).to(out_dtype)
    scales = torch.tensor(2.0), torch.tensor(4.0)
    hardware = scaled_mm(a, scales[0], b, scales[1], out_dtype, hardware=True, bias=bias)
    emulated = scaled_mm(a, scales[0], b, scales[1], out_dtype, hardware=False, bias=bias)
    without = scaled_mm(a, scales[0], b, scales[1], out_dtype, hardware=False)
    torch.testing.assert_close(hardware, emulated, rtol=1e-2, atol=1e-2)
    assert not torch.allclose(hardware, without, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("capability, ok", [((8, 6), False), ((8, 9), True), ((9, 0), True), ((10, 0), True)])
def test_compute_capability_8_9_and_newer_run_fp8_on_the_hardware(monkeypatch, capability, ok):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L40S")
    cuda = torch.device("cuda", 0)
    assert (fp8.fp8_problem(cuda, emulate=False) is None) == ok
    assert fp8.uses_hardware(cuda, emulate=False) == ok
