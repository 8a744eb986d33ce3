"""train.py with train.fused_loss=true: the single-process run's loss at every step, and its evaluations."""
from tests.e2e.common import run_train, step_losses
from tests.harness import EXACT_FP32


def test_fused_loss_run_matches_the_unfused_single_process_run(single_process_run, tmp_path, token_cache):
    proc, metrics = run_train(str(tmp_path), ["train.fused_loss=true"], cache_dir=token_cache)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ref, got = step_losses(single_process_run), step_losses(metrics)
    assert len(got) == len(ref) == 20
    for step, (a, b) in enumerate(zip(got, ref), start=1):
        assert abs(a - b) <= EXACT_FP32["rtol"] * abs(b), f"step {step}: fused {a} vs unfused {b}"
    evals = [m["eval_loss"] for m in metrics if "eval_loss" in m]
    ref_evals = [m["eval_loss"] for m in single_process_run if "eval_loss" in m]
    assert len(evals) == len(ref_evals) and all(abs(a - b) <= EXACT_FP32["rtol"] * b for a, b in zip(evals, ref_evals))
