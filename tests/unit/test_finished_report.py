"""rerun.finished_report: the final loss and eval loss of a finished run, read from metrics.jsonl up to
and including the checkpoint's step. tests/unit/test_hardening.py checks only that damaged lines are passed
over (its one good line is below the step and it has no evaluation)."""
import json

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
