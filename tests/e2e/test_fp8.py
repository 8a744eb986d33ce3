"""train.precision=fp8 end to end on the tiny recipe (cut down as tests/e2e/common.py's SMALL), emulated on
the CPU: the loss curve departs from bf16's yet follows it, and a resumed run continues bit for bit."""
import os

import pytest

from tests.e2e.common import run_train, step_losses

STEPS = 20
# fp8 rounds each linear operand to 3 (gradients: 2) mantissa bits, against bf16's 8: per element that is up to
# 6% (12%), but the errors are unbiased and average out over the 64-128 terms of each dot product. Measured
# on this run the curves part by at most 0.5% of the loss (the model learns 16% in 20 steps); a scale that is
# wrong (inverted: everything in the subnormals) or missing leaves the curve far outside FP8_CURVE.
FP8_CURVE = dict(rel=2e-2, abs=0.0)
RESUME_AT = 16


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory, token_cache):
    out = str(tmp_path_factory.mktemp("fp8"))
    proc, metrics = run_train(out, ["train.precision=fp8", f"checkpoint.every={RESUME_AT}"], cache_dir=token_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fp8 on cpu" in proc.stdout  # the banner names the precision
    return out, metrics


@pytest.fixture(scope="module")
def bf16_losses(tmp_path_factory, token_cache):
    proc, metrics = run_train(str(tmp_path_factory.mktemp("bf16")), ["train.precision=bf16"], cache_dir=token_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return step_losses(metrics)


def test_fp8_loss_curve_differs_from_bf16_but_stays_within_tolerance(fp8_run, bf16_losses):
    fp8_losses = step_losses(fp8_run[1])
    assert len(fp8_losses) == len(bf16_losses) == STEPS
    assert fp8_losses != bf16_losses, "fp8 gave bf16's losses bit for bit: the linears did not quantise"
    assert fp8_losses == pytest.approx(bf16_losses, **FP8_CURVE), f"fp8 {fp8_losses}\nbf16 {bf16_losses}"
    assert fp8_losses[-1] < 0.9 * fp8_losses[0]  # it learns


def test_fp8_resume_is_bitwise_identical(fp8_run, tmp_path, token_cache):
    out, metrics = fp8_run
    ckpt = os.path.join(out, "checkpoints", f"step-{RESUME_AT:08d}")
    proc, resumed = run_train(str(tmp_path), ["train.precision=fp8"], cache_dir=token_cache,
                              extra_args=["--resume", ckpt])
    assert proc.returncode == 0, proc.stderr[-3000:]
    keys = ("step", "loss", "grad_norm", "lr")
    after = [{k: m[k] for k in keys} for m in metrics if "loss" in m and m["step"] > RESUME_AT]
    assert [{k: m[k] for k in keys} for m in resumed if "loss" in m] == after


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_fp8_loss_curve_differs_from_tensorwise_and_bf16_but_stays_within_tolerance(fp8_run, bf16_losses,
                                                                                            tmp_path, token_cache,
                                                                                            recipe):
    """train.fp8_recipe=rowwise (a scale per row of each GEMM operand; e4m3 gradients) and rowwise_with_gw_hp
    (dW in bf16): each its own curve, within FP8_CURVE of bf16's as tensorwise is; a scale per row that is wrong
    (too large: rows saturate) leaves it."""
    proc, metrics = run_train(str(tmp_path), ["train.precision=fp8", f"train.fp8_recipe={recipe}"],
                              cache_dir=token_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rowwise = step_losses(metrics)
    assert len(rowwise) == STEPS and rowwise != step_losses(fp8_run[1]) and rowwise != bf16_losses
    assert rowwise == pytest.approx(bf16_losses, **FP8_CURVE), f"{recipe} {rowwise}\nbf16 {bf16_losses}"
    assert rowwise[-1] < 0.9 * rowwise[0]
