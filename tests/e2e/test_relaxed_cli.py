"""train.py with a relaxed parallel.dp_sync: a 2-replica local_sgd run with an injected straggler and a
checkpoint writes the per-step replica metrics, announces the faults and resumes; bad relaxed input
exits 2 with one line naming the key."""
import os

import pytest

from tests.e2e.common import run_train

RELAXED = ["parallel.dp_sync=local_sgd", "parallel.sync_every=2", "train.steps=4", "run.eval_every=0",
           "checkpoint.every=2", "faults.slow_ranks=[1]", "faults.slow_factor=2"]


def _bad(tmp_path, overrides, nproc=1):
    proc, _ = run_train(str(tmp_path), overrides, nproc=nproc)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip().startswith("error: ")]
    assert len(lines) >= 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_bad_relaxed_input_exits_2_naming_the_key(tmp_path):
    assert "parallel.dp_sync=ssp: needs dp_replicate" in _bad(tmp_path, ["parallel.dp_sync=ssp"])
    assert "parallel.staleness_min" in _bad(tmp_path, ["parallel.dp_sync=dssp", "parallel.staleness_min=3"])
    assert "faults.slow_ranks" in _bad(tmp_path, ["faults.slow_ranks=[2]", "faults.slow_factor=2"])


@pytest.mark.slow
def test_local_sgd_run_logs_replica_metrics_and_resumes(tmp_path, token_cache):
    proc, metrics = run_train(str(tmp_path), RELAXED, nproc=2, cache_dir=token_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FAULT INJECTION ON" in proc.stderr
    steps = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert [m["replica_bytes"] > 0 for m in steps] == [False, True, False, True]  # sync every 2 steps
    assert all("wait_s" in m for m in steps)
    assert os.path.isdir(tmp_path / "checkpoints" / "step-00000002")
    proc, metrics = run_train(str(tmp_path), RELAXED[:2] + ["train.steps=6", "run.eval_every=0"], nproc=2,
                              cache_dir=token_cache, extra_args=["--resume", "auto"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2, 3, 4, 5, 6]
