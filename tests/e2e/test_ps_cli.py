"""train.py with parameter servers (parallel.ps_servers): 2 workers + 1 server under torchrun train,
log their rows and bytes, evaluate and save; a killed server under --max-restarts resumes and ends with
the uninterrupted run's weights; bad input exits 2 with one line naming the key."""
import json
import os

import pytest
import torch

from tests.e2e.common import checkpoint_tensors, run_train
from tests.e2e.test_relaxed_cli import _bad

PS = ["parallel.ps_servers=1", "parallel.dp=2", "train.steps=4", "run.eval_every=2", "checkpoint.every=2"]


def test_two_workers_and_a_server_train_log_and_save(tmp_path, token_cache):
    out = str(tmp_path)
    proc, metrics = run_train(out, PS, nproc=3, cache_dir=token_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "parameter servers: 1 rank(s) after the mesh" in proc.stdout
    steps = [r for r in metrics if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["ps_pull_bytes"] > 0 and r["ps_push_bytes"] > 0 and r["ps_version"] == r["step"] - 1 for r in steps)
    assert any("eval_loss" in r for r in metrics)  # evaluation pulls its rows too
    with open(os.path.join(out, "ps-server-0.jsonl")) as f:
        applies = [json.loads(line) for line in f if '"apply"' in line]
    assert [a["step"] for a in applies] == [1, 2, 3, 4]
    manifest = json.load(open(os.path.join(out, "checkpoints", "step-00000004", "manifest.json")))
    assert manifest["layout"]["ps_servers"] == 1 and "model/embed.weight" in manifest["tensors"]
    # resuming with servers: tests/dist/test_ps.py (round trips) and the killed-server restart below (slow)


@pytest.mark.slow
def test_a_killed_server_resumes_under_torchrun_with_the_uninterrupted_weights(tmp_path, token_cache):
    keys = ["parallel.ps_servers=1", "parallel.dp=2", "train.steps=6", "run.eval_every=0", "checkpoint.every=2"]
    plain, _ = run_train(str(tmp_path / "once"), keys, nproc=3, cache_dir=token_cache)
    assert plain.returncode == 0, plain.stderr[-3000:]
    proc, metrics = run_train(str(tmp_path / "killed"), keys + ["faults.kill_rank=2", "faults.kill_at_step=3"],
                              nproc=3, cache_dir=token_cache, launcher_args=["--max-restarts=1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "at step 2" in proc.stdout
    final = os.path.join("checkpoints", "step-00000006")
    once = checkpoint_tensors(os.path.join(tmp_path / "once", final))
    again = checkpoint_tensors(os.path.join(tmp_path / "killed", final))
    assert sorted(once) == sorted(again)
    for name in once:
        assert torch.equal(once[name], again[name]), name


def test_bad_parameter_server_input_exits_2_naming_the_key(tmp_path):
    """One launch through the CLI; the other refusals are config checks (tests/unit/test_ps.py)."""
    assert "leaves no worker" in _bad(tmp_path, ["parallel.ps_servers=1"])
