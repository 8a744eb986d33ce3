"""train.py under torchrun: every layout reproduces the single-process run's loss at every step."""
import pytest

from tests.e2e.common import run_train, step_losses
from tests.harness import TP_FP32, our_traceback_frames

# Losses are the mean over 256 tokens: fp32 round-off from tp's split reductions stays far below this.
LOSS_TOL = TP_FP32["rtol"]


def _assert_matches_single(single_process_run, out, overrides, nproc, token_cache):
    proc, metrics = run_train(str(out), overrides + ["parallel.microbatches=2"], nproc=nproc, cache_dir=token_cache)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ref = step_losses(single_process_run)
    got = step_losses(metrics)
    assert len(got) == len(ref) == 20
    for step, (a, b) in enumerate(zip(got, ref), start=1):
        assert abs(a - b) <= LOSS_TOL * abs(b), f"step {step}: {a} vs single-process {b}"
    evals = [m["eval_loss"] for m in metrics if "eval_loss" in m]
    ref_evals = [m["eval_loss"] for m in single_process_run if "eval_loss" in m]
    assert len(evals) == len(ref_evals) and all(abs(a - b) <= LOSS_TOL * b for a, b in zip(evals, ref_evals))


@pytest.mark.slow  # train.py runs tp2 + sp in the document-mask e2e test; dist tests cover dp2 x tp2 + sp
def test_dp2_tp2_sequence_parallel_matches_single_process(single_process_run, tmp_path, token_cache):
    _assert_matches_single(single_process_run, tmp_path, ["parallel.tp=2", "parallel.sequence_parallel=true"], 4,
                           token_cache)


@pytest.mark.slow  # the dist pipeline tests cover pp2 x tp2 split backward in the default run
def test_pp2_tp2_1f1b_split_backward_matches_single_process(single_process_run, tmp_path, token_cache):
    _assert_matches_single(single_process_run, tmp_path, ["parallel.tp=2", "parallel.pp=2",
                                                           "parallel.split_backward=true"], 4, token_cache)


@pytest.mark.slow  # the dist pipeline tests cover interleaved-1f1b in the default run
def test_dp2_pp2_interleaved_matches_single_process(single_process_run, tmp_path, token_cache):
    _assert_matches_single(single_process_run, tmp_path, ["parallel.pp=2", "parallel.schedule=interleaved-1f1b",
                                                           "parallel.virtual_stages=2"], 4, token_cache)


@pytest.mark.slow
@pytest.mark.parametrize("overrides,nproc", [
    (["parallel.tp=2"], 2),
    (["parallel.pp=2", "parallel.schedule=gpipe"], 2),
    (["parallel.dp=2", "parallel.tp=2"], 4),
    (["parallel.dp=2", "parallel.pp=2"], 4),
    (["parallel.tp=2", "parallel.pp=2", "parallel.recompute=full"], 4),
])
def test_more_layouts_match_single_process(single_process_run, tmp_path, token_cache, overrides, nproc):
    _assert_matches_single(single_process_run, tmp_path, overrides, nproc, token_cache)


def test_layout_that_does_not_divide_the_world_exits_2(tmp_path, token_cache):
    proc, _ = run_train(str(tmp_path), ["parallel.tp=2"], nproc=3, cache_dir=token_cache)
    # torchrun itself reports a failed child with its own traceback; ours is the one error line,
    # printed once (rank 0), and every rank exits 2; torchrun's summary quotes it as each rank's error
    assert proc.returncode != 0
    printed = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert printed == [printed[0]] and printed[0].startswith(
        "error: world size 3 is not divisible by parallel.tp*parallel.pp=2"), printed
    assert "exitcode  : 2" in proc.stderr
    assert our_traceback_frames(proc.stderr) == [], proc.stderr[-3000:]  # torchrun's own frames are allowed


def test_plain_autograd_accumulation_matches_the_fused_default(single_process_run, tmp_path, token_cache):
    """train.grad_accumulation_fusion=false (weight gradients built, then added) trains the same run to
    round-off as the default, which adds them into .grad in place."""
    _assert_matches_single(single_process_run, tmp_path, ["train.grad_accumulation_fusion=false"], 1, token_cache)
