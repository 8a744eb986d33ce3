"""Restart and resume under torchrun: a rank killed by faults.kill_rank / kill_at_step is restarted by
torchrun --max-restarts 1, the restarted attempt resumes from the newest intact checkpoint without a
flag, and the run ends with the uninterrupted run's losses and weights, bitwise. The killed run saves
in the background (checkpoint.async), the reference synchronously."""
import re

import pytest

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
    got, ref = step_losses(metrics), step_losses(single_process_run)
    assert len(got) == len(ref) == 20
    assert all(abs(a - b) <= tol * abs(b) for a, b in zip(got, ref)), list(zip(got, ref))
