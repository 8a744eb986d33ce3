"""Run feedback and trackers: metrics.jsonl holds every step while the console prints every
log_every; banner, ETA, checkpoint, eval and summary lines of a real run; explicit trackers."""
import dataclasses
import json
import os
import sys
import types

import pytest

from pipetrain.config import ConfigError, build_recipe
from pipetrain.metrics import MetricsLogger, format_duration, steady_tokens_per_sec
from pipetrain.parallel.mesh.dims import ParallelDims
from tests.e2e.common import run_train
from tests.unit.common import TINY_MOE
from tests.unit.short_run import LOG_EVERY, STEPS, short_run


def _record(step: int) -> dict:
    return {"step": step, "loss": 5.0 - step * 0.1, "lr": 1e-3, "grad_norm": 0.5, "tokens": step * 256,
            "tokens_per_sec": 1000.0, "step_time_s": 0.256, "peak_mem_bytes": 1}


def test_metrics_file_holds_every_step_and_the_console_every_log_every(tmp_path, capsys):
    logger = MetricsLogger(str(tmp_path), enabled=True, total_steps=7, progress=False, log_every=3)
    for step in range(1, 8):
        logger.log(_record(step))
    logger.log({"step": 7, "eval_loss": 2.0, "eval_tokens": 64})
    logger.close()
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in lines if "loss" in r] == list(range(1, 8))
    printed = capsys.readouterr().out.splitlines()
    assert [ln.split("|")[0].split()[1] for ln in printed if ln.startswith("step")] == ["3/7", "6/7", "7/7"]
    assert "eta" in printed[0] and "elapsed" in printed[0]
    assert printed[-1].startswith("eval at step 7: loss 2.0000 | perplexity 7.39")


def test_a_diverged_eval_loss_prints_an_infinite_perplexity_not_an_overflow(tmp_path, capsys):
    logger = MetricsLogger(str(tmp_path), enabled=True, total_steps=1, progress=False, log_every=1)
    logger.log({"step": 1, "eval_loss": 1000.0, "eval_tokens": 64})  # exp(1000) overflows a float
    logger.close()
    assert capsys.readouterr().out.splitlines()[-1].startswith("eval at step 1: loss 1000.0000 | perplexity inf")


def test_a_real_run_reports_where_it_is():
    out, proc, metrics = short_run()
    assert [m["step"] for m in metrics if "loss" in m] == list(range(1, STEPS + 1))
    lines = proc.stdout.splitlines()
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert [ln.split()[1] for ln in steps] == [f"{s}/{STEPS}" for s in range(LOG_EVERY, STEPS + 1, LOG_EVERY)]
    assert all(" | elapsed " in ln and " | eta " in ln for ln in steps)
    assert steps[-1].endswith("eta 0s")
    first = next(i for i, ln in enumerate(lines) if ln.startswith("model: "))  # the data layer may print first
    banner = "\n".join(lines[first:first + 6])
    for part in ("model: llama", "parameters", "layout: 1 rank(s) = dp 1 x tp 1 x pp 1",
                 "tokens per step: 8 sequences x 32 = 256", f"output: {out}", "start: fresh run from step 0 of 6",
                 "memory: predicted peak "):
        assert part in banner, banner
    saves = [ln for ln in lines if ln.startswith("checkpoint at step")]
    assert len(saves) == 2 and os.path.join(out, "checkpoints", "step-00000006") in saves[1]
    assert saves[1].endswith(" s)") and " MB, " in saves[1]
    evals = [ln for ln in lines if ln.startswith("eval at step")]
    assert len(evals) == 2 and all("perplexity" in ln for ln in evals)
    done = [ln for ln in lines if ln.startswith("done: ")]
    assert len(done) == 1 and f"{STEPS * 256:,} tokens" in done[0] and "final loss" in done[0]
    assert f"final loss {[m for m in metrics if 'loss' in m][-1]['loss']:.4f}" in done[0]
    steady = steady_tokens_per_sec([m["tokens_per_sec"] for m in metrics if "loss" in m])
    assert f"tok/s wall clock), steady state {steady:,.0f} tok/s (median of steps 3-{STEPS})" in done[0], done[0]
    assert "--- sample after 6 steps ---" in proc.stdout


def test_the_banner_names_expert_parallelism_and_the_replicas(tmp_path, capsys):
    """ep and HSDP's dp_shard split the dp ranks: the layout line names the ep degree and the replicas line
    dp_shard, so a run's log says how the experts and the shards were laid out."""
    recipe = build_recipe({"model": dataclasses.asdict(TINY_MOE), "train": {"global_batch": 8, "seq_len": 32},
                           "data": {"path": "x", "tokenizer": "y"}})
    logger = MetricsLogger(str(tmp_path), enabled=True, total_steps=1, progress=False)
    logger.banner(recipe, ParallelDims(dp=4, ep=2, dp_shard=2))
    logger.close()
    printed = capsys.readouterr().out
    assert "layout: 4 rank(s) = dp 4 x tp 1 x pp 1 (experts over ep 2 of the dp ranks) | " in printed, printed
    assert "replicas: 2 x dp_shard 2 | " in printed, printed


def test_unknown_tracker_is_a_config_error_and_exits_2_with_one_line(tmp_path):
    with pytest.raises(ConfigError, match="run.trackers: unknown tracker, got 'mlflow'"):
        build_recipe({"run": {"trackers": ["mlflow"]}, "data": {"path": "x", "tokenizer": "y"}})
    proc, _ = run_train(str(tmp_path), ["run.trackers=[mlflow]"])
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "unknown tracker, got 'mlflow'" in lines[0], proc.stderr


def test_a_missing_tracker_extra_is_named_on_every_rank(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if the extra were not installed
    for enabled in (True, False):
        with pytest.raises(ConfigError, match=r'pip install -e "\.\[wandb\]"'):
            MetricsLogger(str(tmp_path), enabled=enabled, total_steps=1, progress=False, trackers=["wandb"])


def test_wandb_runs_offline_without_credentials(tmp_path, monkeypatch):
    calls = []

    class FakeRun:
        def log(self, values, step):
            calls.append(("log", step, values))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    logger = MetricsLogger(str(tmp_path), enabled=True, total_steps=1, progress=False, trackers=["wandb"],
                           config={"train": {"lr": 1e-3}})
    logger.log(_record(1))
    logger.close()
    assert calls[0][1]["mode"] == "offline" and calls[0][1]["dir"] == str(tmp_path)
    assert calls[0][1]["config"] == {"train": {"lr": 1e-3}}
    assert calls[1][:2] == ("log", 1) and calls[1][2]["loss"] == pytest.approx(4.9) and calls[-1] == ("finish",)
    monkeypatch.setenv("WANDB_API_KEY", "k")
    MetricsLogger(str(tmp_path), enabled=True, total_steps=1, progress=False, trackers=["wandb"]).close()
    assert calls[-2][1]["mode"] == "online"


def test_tensorboard_writes_only_when_asked_for(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    os.makedirs(tmp_path / "off")
    MetricsLogger(str(tmp_path / "off"), enabled=True, total_steps=1, progress=False).close()  # run.trackers: []
    assert not os.path.exists(tmp_path / "off" / "tensorboard")
    logger = MetricsLogger(str(tmp_path), enabled=True, total_steps=2, progress=False, trackers=["tensorboard"])
    logger.log(_record(1))
    logger.log(_record(2))
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [round(e.value, 4) for e in events.Scalars("loss")] == [4.9, 4.8]


def test_durations_read_at_a_glance():
    assert [format_duration(s) for s in (0.4, 45, 192, 7500)] == ["0s", "45s", "3m12s", "2h05m"]
