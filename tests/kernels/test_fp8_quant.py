"""fp8 quantisation: the Triton amax and cast (interpreted) against the reference, bit for bit."""
import pytest
import torch

from pipetrain.kernels import fp8_quant
from pipetrain.kernels.fp8_quant import (fp8_cast, fp8_columns, fp8_max, quantize_ref, quantize_tensorwise,
                                         scale_from_amax)
from tests.kernels.common import fresh_seed, randn

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _layout(t: torch.Tensor) -> tuple:
    return t.dtype, t.shape, tuple(s for s, n in zip(t.stride(), t.shape) if n > 1)  # a size-1 dim's stride is moot


def _assert_same(got, want, seed=None):
    (q, scale, cols), (rq, rscale, rcols) = got, want
    assert torch.equal(scale, rscale), f"seed={seed}: scale {scale} vs {rscale}"
    for name, a, b in (("q", q, rq), ("columns", cols, rcols)):
        assert (a is None) == (b is None), name
        if a is not None:
            assert _layout(a) == _layout(b), (name, _layout(a), _layout(b))
            bad = (_bits(a) != _bits(b)).nonzero()[:3].tolist()
            assert not bad, f"seed={seed} {name}: differs at {bad}"


# one element; sizes that are not multiples of the 64 x 64 tile; more than one 4096-element amax block
SHAPES = [(1, 1), (3, 200), (257, 5), (130, 70)]


@pytest.mark.triton
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quantize_triton_equals_reference_in_both_layouts(force_triton, poisoned, shape, fmt, dtype):
    seed = fresh_seed()
    x = randn(seed, *shape, dtype=dtype, scale=3.0)
    for rows, columns in ((True, False), (False, True), (True, True)):
        _assert_same(quantize_tensorwise(x, fmt, rows=rows, columns=columns),
                     quantize_ref(x, fmt, rows=rows, columns=columns), seed)


@pytest.mark.triton
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_quantize_triton_rounds_every_binade_and_subnormal_as_torch(force_triton, fmt):
    # every float8 value, the midpoints between neighbours (ties: to even), and values a hair either side of
    # each midpoint, with amax = the format's max so the scale is 1: the rounding itself, subnormals included
    values = torch.arange(256, dtype=torch.uint8).view(fmt).float()
    values = values[values.isfinite() & (values >= 0)].unique()
    mids = (values[1:] + values[:-1]) / 2
    grid = torch.cat([values, mids, mids * (1 + 2**-20), mids * (1 - 2**-20), values[:1] + 2.0**-30])
    x = torch.cat([grid, -grid, torch.tensor([-0.0, fmp := fp8_max(fmt)])]).reshape(1, -1)
    assert fmp == x.abs().max()
    _assert_same(quantize_tensorwise(x, fmt, columns=True), quantize_ref(x, fmt, columns=True))


@pytest.mark.triton
def test_quantize_triton_scale_edges_zero_inf_nan_and_saturation(force_triton):
    fmt = torch.float8_e4m3fn
    cases = {"zeros": torch.zeros(4, 8), "inf": torch.tensor([[1.0, float("inf"), -2.0]]),
             "nan": torch.tensor([[1.0, float("nan"), -2.0]]), "tiny": torch.full((2, 3), 1e-30)}
    for name, x in cases.items():
        (q, scale, _), (rq, rscale, _) = quantize_tensorwise(x, fmt), quantize_ref(x, fmt)
        assert torch.equal(scale.isnan(), rscale.isnan()) and (scale.isnan() or scale == rscale), name
        torch.testing.assert_close(q.float(), rq.float(), equal_nan=True, rtol=0, atol=0, msg=name)
    # a scale from a smaller amax (the tp reduction can only raise it, but a caller may pass any): saturates
    q, scale, _ = fp8_cast(torch.tensor([[1.0, -1000.0, 3.0]]), torch.tensor([1.0]), fmt)
    assert scale == 256.0 and q.float().tolist() == [[256.0, -448.0, 448.0]]


@pytest.mark.triton
def test_quantize_triton_scale_is_the_exact_power_of_two(force_triton):
    # amax just above fp8_max / 2^k: the exact floor(log2(fp8_max / amax)) is k - 1, so amax * scale <= fp8_max
    fmt = torch.float8_e4m3fn
    for k in (0, 3, 7):
        amax = torch.tensor([fp8_max(fmt) / 2**k]).nextafter(torch.tensor([float("inf")]))
        _, scale, _ = fp8_cast(torch.ones(1, 1), amax, fmt)
        assert scale == 2.0 ** (k - 1) and amax * scale <= fp8_max(fmt), (k, scale)
        assert scale == scale_from_amax(amax, fmt).reshape(())


@pytest.mark.triton
def test_quantize_triton_reduces_the_amax_through_the_callers_function(force_triton):
    x = torch.tensor([[0.5, -1.0]])
    seen = []

    def reduce_amax(amax):  # what tp does: the max over ranks, here a rank holding 100
        seen.append(amax.clone())
        return torch.maximum(amax, torch.tensor([100.0]))
    q, scale, _ = quantize_tensorwise(x, torch.float8_e4m3fn, reduce_amax)
    assert seen[0].tolist() == [1.0] and scale == 4.0 and q.float().tolist() == [[2.0, -4.0]]


def _no_kernels(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a float8 kernel was launched")
    monkeypatch.setattr(fp8_quant, "fp8_amax", refuse)
    monkeypatch.setattr(fp8_quant, "fp8_cast", refuse)


def test_quantize_takes_the_reference_without_the_triton_switch_for_fp16_and_below_sm89(monkeypatch):
    _no_kernels(monkeypatch)
    x = torch.randn(5, 6)
    q = torch.randn(5, 6).to(torch.float8_e4m3fn)
    _assert_same(quantize_tensorwise(x, torch.float8_e5m2, columns=True),
                 quantize_ref(x, torch.float8_e5m2, columns=True))  # a CPU tensor, PIPETRAIN_KERNELS unset
    assert torch.equal(_bits(fp8_columns(q)), _bits(q)) and fp8_columns(q).t().is_contiguous()
    monkeypatch.setenv("PIPETRAIN_KERNELS", "triton")  # the Triton path asked for, but:
    half = torch.randn(5, 6, dtype=torch.float16)  # fp16: not a dtype of the cast kernel
    _assert_same(quantize_tensorwise(half, torch.float8_e4m3fn), quantize_ref(half, torch.float8_e4m3fn))
    monkeypatch.setattr(fp8_quant, "kernels_build_on", lambda device: False)  # a card older than sm_89
    _assert_same(quantize_tensorwise(x, torch.float8_e4m3fn), quantize_ref(x, torch.float8_e4m3fn))
    assert torch.equal(_bits(fp8_columns(q)), _bits(q))
    with pytest.raises(ValueError, match="2-D"):
        quantize_tensorwise(torch.randn(2, 3, 4), torch.float8_e5m2)


def test_float8_kernels_build_from_compute_capability_8_9(monkeypatch):
    # Triton has float8e4nv only from sm_89: an A100 under train.fp8_emulate takes the reference
    cuda = torch.device("cuda", 0)
    for capability, builds in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert fp8_quant.kernels_build_on(cuda) == builds, capability
    assert fp8_quant.kernels_build_on(torch.device("cpu"))  # the interpreter


@pytest.mark.triton
@pytest.mark.parametrize("shape", [(1, 1), (130, 70), (3, 200)], ids=str)
def test_fp8_columns_copies_the_bytes_column_major(force_triton, poisoned, shape):
    seed = fresh_seed()
    q = randn(seed, *shape, scale=100.0).to(torch.float8_e5m2)
    q.view(-1)[0] = float("nan")
    cols = fp8_columns(q)
    assert cols.shape == q.shape and cols.t().is_contiguous() and torch.equal(_bits(cols), _bits(q)), seed
    assert fp8_columns(cols) is cols  # column-major already: nothing to do


@pytest.mark.triton
@pytest.mark.parametrize("microbatches", [1, 2], ids=["per-call-weights", "weight-cache"])
@pytest.mark.parametrize("hardware", [False, True], ids=["emulated", "scaled_mm"])
def test_fp8_training_through_the_triton_casts_gives_the_reference_losses_bit_for_bit(tmp_path, monkeypatch,
                                                                                     hardware, microbatches):
    """Eager fp8 training (a GPT-2 block: biases; clipping) with only the fp8 quantisation on its Triton path
    (interpreted) against the torch reference: every amax, scale and float8 value is the same, so the losses are
    equal. hardware: torch._scaled_mm forced (it runs on the CPU too), where the casts write dy's column-major
    copy and the tiled transposes give xq's (and, without the weight cache, the weights'). One microbatch: each
    linear quantises its fp32 weight in its call (the benchmark rows' case); two: fp8.Fp8WeightCache does."""
    from pipetrain.parallel.tensor import fp8
    from tests.unit.common import GPT2, build_trainer

    monkeypatch.setattr(fp8, "uses_hardware", lambda device, emulate: hardware)
    launches = []
    real_cast = fp8_quant.fp8_cast

    def counting_cast(x, amax, dtype, rows=True, columns=False):
        launches.append((x.dtype == dtype, rows, columns, x.dtype))
        return real_cast(x, amax, dtype, rows, columns)

    def losses(name, triton_casts: bool):
        with monkeypatch.context() as m:
            m.setattr(fp8_quant, "use_triton", lambda x: triton_casts)
            m.setattr(fp8_quant, "fp8_cast", counting_cast)
            (tmp_path / name).mkdir()
            trainer = build_trainer(GPT2, str(tmp_path / name), precision="fp8", steps=3, microbatches=microbatches,
                                    learnable=True)
            return [trainer.train_step()["loss"] for _ in range(3)]

    want = losses("reference", False)
    assert not launches
    got = losses("triton", True)
    assert got == want, f"Triton casts {got} against the reference {want}"
    assert got[-1] < got[0]  # it trains
    quantise = [k for k in launches if not k[0]]
    assert quantise and any(rows and not columns for _, rows, columns, _ in quantise)  # x, and the weights
    assert any(dtype == torch.float32 for *_, dtype in quantise) == (microbatches == 1)  # fp32 masters per call
    # dy: column-major too on the scaled_mm path (dW's operand); xq's and the weights' transposes: copies
    assert any(columns for _, _, columns, _ in quantise) == hardware
    assert any(copy for copy, *_ in launches) == hardware
