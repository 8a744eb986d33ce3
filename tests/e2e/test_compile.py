"""train.compile end to end: train.py with inductor gives the eager run's losses (the one inductor test of
the default run), and a machine where inductor cannot compile gets a one-line error with the fix (exit 2)."""
from __future__ import annotations

import torch

from pipetrain import cli
from tests.e2e.common import SMALL, TINY, read_metrics, run_train, step_losses

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


def test_compile_without_a_cpp_compiler_is_one_line_error_and_exit_2(tmp_path, monkeypatch, capsys):
    # In process (pipetrain.cli.main, as tests/unit/test_bad_sizes.py does): a train.py subprocess would spend
    # seconds importing torch and inductor again. inductor's compiler search tries only cpp.cxx, which it
    # reads from CXX when first imported: set the list itself, since this process may have imported it.
    import torch._inductor.config as inductor_config  # deferred as in pipetrain.models.compile: heavy
    # inductor's own patch(), not monkeypatch: monkeypatch's undo deletes a sub-config key such as cpp.cxx
    # (the proxy hides it from its __dict__), which broke every later test that reads it
    monkeypatch.delenv("PIPETRAIN_COMPILE_BACKEND", raising=False)
    out = str(tmp_path / "run")
    sets = SMALL + [f"run.output_dir={out}", "train.steps=1", "run.eval_every=0", "train.compile=true"]
    with inductor_config.patch({"cpp.cxx": (str(tmp_path / "no-such-g++"),)}):
        code = cli.main(["--recipe", TINY] + [a for s in sets for a in ("--set", s)])
    lines = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and not read_metrics(out), lines
    assert lines[0].startswith("error: train.compile=true: inductor on the CPU needs a C++ compiler") \
        and "no-such-g++" in lines[0] and "set train.compile=false" in lines[0], lines[0]
