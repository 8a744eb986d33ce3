"""Restart and resume under torchrun: a rank killed by faults.kill_rank / kill_at_step is restarted by
torchrun --max-restarts 1, the restarted attempt resumes from the newest intact checkpoint without a
flag, and the run ends with the uninterrupted run's losses and weights, bitwise. The killed run saves
in the background (checkpoint.async), the reference synchronously."""
import os
import re

import pytest
import yaml

from tests.e2e.common import checkpoint_tensors, run_train, step_losses
from tests.harness import TP_FP32

RUN = ["train.steps=6", "checkpoint.every=2", "run.eval_every=0", "parallel.microbatches=2"]


def test_a_killed_rank_restarts_and_ends_on_the_uninterrupted_weights_bitwise(tmp_path, token_cache):
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    proc, ref_metrics = run_train(str(ref), RUN, nproc=2, cache_dir=token_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, metrics = run_train(str(killed), RUN + ["faults.kill_rank=1", "faults.kill_at_step=5",
                                                  "checkpoint.async=true"], nproc=2,
                              cache_dir=token_cache, launcher_args=["--max-restarts=1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 1 will be killed (SIGKILL) as step 5 begins" in proc.stderr
    assert "killing rank 1 at the start of step 5" in proc.stderr
    assert "torchrun restart 1: resuming from the newest intact checkpoint" in proc.stdout
    # the save at step 4 waits for step 2's background write, so step 2's checkpoint is complete; step 4's
    # may or may not have been written before the kill: the restart names what it lost either way
    found = re.search(r"resumed from \S+ at step (\d+); (\d+) logged step\(s\) after it are lost", proc.stdout)
    assert found and int(found[1]) in (2, 4) and int(found[2]) == 4 - int(found[1]), proc.stdout
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2, 3, 4, 5, 6]
    assert step_losses(metrics) == step_losses(ref_metrics)  # exact float equality
    a = checkpoint_tensors(ref / "checkpoints" / "step-00000006")
    b = checkpoint_tensors(killed / "checkpoints" / "step-00000006")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), "final weights/moments differ"


def test_a_pinned_dp2_run_resumes_on_1_process_with_the_single_process_losses(single_process_run, tmp_path,
                                                                              token_cache):
    """Elastic resume (pipetrain.elastic): the recipe pins dp=2 for 2 processes; resumed on 1 process, dp follows
    the world, the microbatch size is kept (2 microbatches of 2 sequences -> 4 of 2), the global batch stays and
    the loss curve is the single-process run's. A world that tp*pp does not divide is refused first, untouched."""
    out = tmp_path / "elastic"
    pinned = ["parallel.dp=2", "parallel.microbatches=2", "checkpoint.every=4"]
    proc, _ = run_train(str(out), pinned + ["faults.kill_rank=0", "faults.kill_at_step=5"], nproc=2,
                        cache_dir=token_cache)
    assert proc.returncode != 0 and "killing rank 0 at the start of step 5" in proc.stderr
    saved = sorted(os.listdir(out / "checkpoints"))
    proc, _ = run_train(str(out), pinned + ["parallel.tp=2"], cache_dir=token_cache, extra_args=["--resume", "auto"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: elastic resume: ") and "saved on 2 rank(s)" in line
    assert "world size 1 is not divisible by parallel.tp*parallel.pp=2; launch a multiple of 2" in line
    assert sorted(os.listdir(out / "checkpoints")) == saved
    proc, metrics = run_train(str(out), pinned, cache_dir=token_cache, extra_args=["--resume", "auto"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("on 1 rank(s): dp 1 x tp 1 x pp 1, 4 microbatch(es) of 2 sequence(s) per replica; global batch 8 "
            "unchanged") in proc.stdout
    assert "resumed from" in proc.stdout and "at step 4;" in proc.stdout
    with open(out / "recipe.yaml") as f:
        parallel = yaml.safe_load(f)["parallel"]
    assert (parallel["dp"], parallel["microbatches"]) == (1, 4)
    got, ref = step_losses(metrics), step_losses(single_process_run)
    assert len(got) == len(ref) == 20
    assert all(abs(a - b) <= TP_FP32["rtol"] * abs(b) for a, b in zip(got, ref)), list(zip(got, ref))


@pytest.mark.slow
def test_a_4_process_run_continues_on_2_processes_with_the_single_process_losses(single_process_run, tmp_path,
                                                                                token_cache):
    """Elastic by resharding: the world shrinks from 4 to 2 at a failure; dp follows the world, the global
    batch stays, and the loss curve is the single-process run's (the layout rule)."""
    tol = TP_FP32["rtol"]
    out = tmp_path / "elastic"
    proc, _ = run_train(str(out), ["checkpoint.every=10", "parallel.microbatches=2", "faults.kill_rank=0",
                                   "faults.kill_at_step=11"], nproc=4, cache_dir=token_cache)
    assert proc.returncode != 0 and "killing rank 0 at the start of step 11" in proc.stderr
    proc, metrics = run_train(str(out), ["checkpoint.every=10", "parallel.microbatches=2"], nproc=2,
                              cache_dir=token_cache, extra_args=["--resume", "auto"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "at step 10;" in proc.stdout and "layout: 2 rank(s) = dp 2" in proc.stdout
    assert "on 2 rank(s): dp 2 x tp 1 x pp 1, 4 microbatch(es) of 1 sequence(s) per replica" in proc.stdout
    got, ref = step_losses(metrics), step_losses(single_process_run)
    assert len(got) == len(ref) == 20
    assert all(abs(a - b) <= tol * abs(b) for a, b in zip(got, ref)), list(zip(got, ref))
