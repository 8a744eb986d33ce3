"""The V schedules through train.py: zbv reproduces the single-process run, composes with tp and dp, and
its checkpoints load into 1f1b and back (parameter names are global whatever the stage placement)."""
import pytest

from tests.e2e.common import run_train, step_losses
from tests.e2e.test_checkpoint import CKPT, _resume_copy
from tests.e2e.test_parallel_train import _assert_matches_single
from tests.harness import TP_FP32

ZBV = ["parallel.pp=2", "parallel.schedule=zbv", "parallel.virtual_stages=2"]


def test_pp2_zbv_matches_single_process(single_process_run, tmp_path, token_cache):
    _assert_matches_single(single_process_run, tmp_path, ZBV, 2, token_cache)


@pytest.mark.slow
def test_dp2_tp2_pp2_zbv_matches_single_process(single_process_run, tmp_path, token_cache):
    _assert_matches_single(single_process_run, tmp_path, ZBV + ["parallel.tp=2", "parallel.dp=2"], 8, token_cache)


@pytest.mark.slow  # three 2-process runs, ~140 s on 2 cores
def test_zbv_checkpoint_loads_into_1f1b_and_back(tmp_path, token_cache):
    proc, full = run_train(str(tmp_path / "zbv"), CKPT + ZBV, nproc=2, cache_dir=token_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = _resume_copy(tmp_path / "zbv", 4, tmp_path / "1f1b")
    proc, got = run_train(str(resumed), CKPT + ["parallel.pp=2"], nproc=2, cache_dir=token_cache,
                          extra_args=["--resume", "auto"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for a, b in zip(step_losses(got), step_losses(full)[4:], strict=True):
        assert abs(a - b) <= TP_FP32["rtol"] * b
    # and back: the 1f1b run's last checkpoint continues under zbv
    back = _resume_copy(resumed, 6, tmp_path / "back")
    proc, more = run_train(str(back), CKPT + ZBV + ["train.steps=7"], nproc=2, cache_dir=token_cache,
                           extra_args=["--resume", "auto"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [m["step"] for m in more if "loss" in m] == [7]
