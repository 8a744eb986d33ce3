"""rerun.finished_report: the final loss and eval loss of a finished run, read from metrics.jsonl up to
and including the checkpoint's step. tests/unit/test_hardening.py checks only that damaged lines are passed
over (its one good line is below the step and it has no evaluation)."""
import json
import os
import threading

import pytest

from pipetrain.config import Recipe, RunConfig
from pipetrain.rerun import SavedRun, finished_report


def _report(tmp_path, records, step):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    recipe = Recipe(run=RunConfig(output_dir=str(tmp_path)))
    return finished_report(SavedRun(str(tmp_path / "checkpoints" / f"step-{step:08d}"), step, {}), recipe)


def test_the_report_gives_the_loss_and_eval_loss_logged_at_the_checkpoints_step(tmp_path):
    records = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}, {"step": 2, "eval_loss": 2.25, "eval_tokens": 8},
               {"step": 3, "loss": 1.0}, {"step": 3, "eval_loss": 1.5, "eval_tokens": 8}]  # 3: past the checkpoint
    line = _report(tmp_path, records, 2)
    assert "final loss 2.0000 at step 2" in line, line
    assert "eval loss 2.2500 at step 2" in line, line


def test_a_damaged_eval_loss_is_passed_over_for_the_last_good_one(tmp_path):
    records = [{"step": 1, "loss": 3.0}, {"step": 1, "eval_loss": 2.75}, {"step": 2, "eval_loss": "bad"},
               {"step": 2, "eval_loss": None}]
    line = _report(tmp_path, records, 2)
    assert "eval loss 2.7500 at step 1" in line, line


@pytest.mark.parametrize("kind", ["pipe", "link"])
def test_a_metrics_pipe_or_link_is_not_read(tmp_path, kind):
    """A finished run launched again read a metrics.jsonl pipe forever (a hang before anything was said), and read
    a link to a file outside the run folder. The report then leaves the metrics out."""
    victim = tmp_path / "victim.jsonl"
    victim.write_text(json.dumps({"step": 2, "loss": 9.0}) + "\n")
    out = tmp_path / "run"
    out.mkdir()
    os.mkfifo(out / "metrics.jsonl") if kind == "pipe" else os.symlink(victim, out / "metrics.jsonl")
    recipe = Recipe(run=RunConfig(output_dir=str(out)))
    lines = []
    reader = threading.Thread(target=lambda: lines.append(finished_report(
        SavedRun(str(out / "checkpoints" / "step-00000002"), 2, {}), recipe)), daemon=True)
    reader.start()
    reader.join(timeout=20)
    if reader.is_alive():  # unblock the read the report is stuck in, then fail
        os.close(os.open(out / "metrics.jsonl", os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("finished_report blocked reading a pipe")
    assert "already finished" in lines[0] and "final loss" not in lines[0], lines
