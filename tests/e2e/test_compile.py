"""train.compile end to end: train.py with inductor gives the eager run's losses, and a machine where
inductor cannot compile gets a one-line error with the fix (exit 2)."""
from __future__ import annotations

import torch

from tests.e2e.common import run_train, step_losses

# inductor fuses the block's elementwise ops and reorders fp32 reductions: round-off, a few steps deep
INDUCTOR_FP32 = dict(rtol=1e-5, atol=1e-6)
QUICK = ["train.steps=4", "run.eval_every=0", "run.eval_batches=1"]
METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_sec", "step_time_s", "peak_mem_bytes"}


def test_inductor_compiled_blocks_match_the_eager_run(tmp_path, monkeypatch):
    monkeypatch.delenv("PIPETRAIN_COMPILE_BACKEND", raising=False)  # inductor, as a recipe run gets it
    eager, eager_metrics = run_train(str(tmp_path / "eager"), QUICK)
    compiled, metrics = run_train(str(tmp_path / "compiled"), QUICK + ["train.compile=true"])
    assert eager.returncode == 0, eager.stderr[-3000:]
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    torch.testing.assert_close(torch.tensor(step_losses(metrics)), torch.tensor(step_losses(eager_metrics)),
                               **INDUCTOR_FP32)
    steps = [m for m in metrics if "loss" in m]
    assert len(steps) == 4 and all(set(m) == METRIC_KEYS for m in steps), steps  # the metrics contract holds
    done = [ln for ln in compiled.stdout.splitlines() if ln.startswith("done: ")]
    assert len(done) == 1 and "tok/s wall clock" in done[0] and "steady state " in done[0] \
        and "(median of steps 3-4)" in done[0], compiled.stdout[-2000:]


def test_compile_without_a_cpp_compiler_is_one_line_error_and_exit_2(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))  # inductor's compiler search tries only this
    monkeypatch.delenv("PIPETRAIN_COMPILE_BACKEND", raising=False)
    proc, metrics = run_train(str(tmp_path / "run"), ["train.steps=1", "run.eval_every=0", "train.compile=true"])
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and not metrics, proc.stderr[-3000:]
    assert lines[0].startswith("error: train.compile=true: inductor on the CPU needs a C++ compiler") \
        and "no-such-g++" in lines[0] and "set train.compile=false" in lines[0], lines[0]
