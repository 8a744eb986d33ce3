"""parallel.auto at launch and train.py --dry-run, through the real command line."""
import ast
import os
import re

import pytest
import yaml

from tests.e2e.common import run_train, step_losses
from tests.harness import TP_FP32

LOSS_TOL = TP_FP32["rtol"]


@pytest.mark.parametrize("nproc,fixed", [(2, ["parallel.pp=2"]), pytest.param(4, [], marks=pytest.mark.slow)])
def test_auto_layout_trains_like_one_process_and_keeps_fixed_keys(single_process_run, tmp_path, token_cache,
                                                                    nproc, fixed):
    proc, metrics = run_train(str(tmp_path), ["parallel.auto=true"] + fixed, nproc=nproc, cache_dir=token_cache)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"parallel.auto on {nproc} x" in proc.stdout and "tokens/s" in proc.stdout
    with open(os.path.join(tmp_path, "recipe.yaml")) as f:
        parallel = yaml.safe_load(f)["parallel"]
    assert parallel["dp"] * parallel["tp"] * parallel["pp"] == nproc  # resolved values written out
    if fixed:
        assert parallel["pp"] == 2
    ref, got = step_losses(single_process_run), step_losses(metrics)
    assert len(got) == len(ref) == 20
    for step, (a, b) in enumerate(zip(got, ref), start=1):
        assert abs(a - b) <= LOSS_TOL * abs(b), f"step {step}: {a} vs single-process {b} ({parallel})"


def test_dry_run_prints_stages_schedule_and_memory_without_data(tmp_path):
    # data.path does not exist: a dry run must not touch it
    proc, _ = run_train(str(tmp_path / "run"), ["parallel.pp=2", "parallel.microbatches=4", "parallel.tp=2",
                                               f"data.path={tmp_path}/missing"], extra_args=["--dry-run", "--nproc", "4"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "valid for 4 process(es): dp=1 tp=2 pp=2" in out
    stages = [ast.literal_eval(re.search(rf"pp rank {r}: layers (\[[^]]*\])", out).group(1)) for r in range(2)]
    assert stages[0] + stages[1] == [0, 1, 2, 3] and all(stages)  # the 4 layers, in order, over both ranks
    assert "bubble" in out and "rank 1 |" in out and "predicted peak memory" in out
    assert not os.path.exists(tmp_path / "run")  # nothing written


def test_dry_run_rejects_a_layout_that_does_not_divide(tmp_path):
    proc, _ = run_train(str(tmp_path), ["parallel.tp=3"], extra_args=["--dry-run", "--nproc", "4"])
    assert proc.returncode == 2
    assert proc.stderr.count("error: world size 4 is not divisible by parallel.tp*parallel.pp=3") == 1
