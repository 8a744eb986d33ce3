"""train.py with parameter servers (parallel.ps_servers): 2 workers + 1 server under torchrun train,
log their rows and bytes, evaluate and save; a killed server under --max-restarts resumes and ends with
the uninterrupted run's weights; bad input (tied embeddings, ssp without staleness, a world that is not
dp*tp*pp + S) exits 2 with one line naming the key, before any process group or data is set up."""
import json
import os

import pytest
import torch

from tests.e2e.common import checkpoint_tensors, refused_in_process, run_train
from tests.harness import our_traceback_frames

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


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.strip().startswith("error: ")]


def test_bad_parameter_server_input_exits_2_with_one_line_naming_the_key(tmp_path, capsys):
    """One process each (in this process): the recipe checks run before the world is looked at; the world
    check is the same arithmetic (processes - servers against dp*tp*pp) whether it counts WORLD_SIZE or
    --dry-run's --nproc."""
    def _refused(tmp_path, overrides, extra_args=()):
        return refused_in_process(capsys, str(tmp_path), overrides, extra_args)
    assert "leaves no worker" in _refused(tmp_path, ["parallel.ps_servers=1"])
    tied = _refused(tmp_path, ["parallel.ps_servers=1", "model.tie_embeddings=true"])
    assert "needs an untied input embedding" in tied and "model.tie_embeddings=false" in tied, tied
    ssp = _refused(tmp_path, ["parallel.ps_servers=1", "parallel.ps_sync=ssp"])
    assert "parallel.ps_sync=ssp needs parallel.staleness >= 1" in ssp, ssp
    # dp 2 + 1 server on 4 processes: 3 workers where the mesh has 2
    world = _refused(tmp_path, ["parallel.ps_servers=1", "parallel.dp=2"], extra_args=["--dry-run", "--nproc", "4"])
    assert "does not equal the world size 3 without the servers; launch 3 processes (2 workers + 1 server(s)" \
        in world, world


def test_a_world_without_room_for_the_mesh_and_servers_exits_2_under_torchrun(tmp_path):
    """dp 2 + 1 server launched on 2 processes: the ranks refuse before joining a process group and only
    rank 0 prints. torchrun itself exits 1 with its own report (and traceback) of the child's exit 2."""
    proc, _ = run_train(str(tmp_path), ["parallel.ps_servers=1", "parallel.dp=2"], nproc=2)
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert "world size 1 without the servers; launch 3 processes (2 workers + 1 server(s)" in lines[0], lines
    assert our_traceback_frames(proc.stderr) == [], proc.stderr[-3000:]  # torchrun's own frames are allowed
