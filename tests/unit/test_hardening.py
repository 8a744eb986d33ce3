"""Hardening without training: torn metrics, the output-dir lock, pre-flight sizes, failed saves."""
import errno
import json
import os

import numpy as np
import pytest

from pipetrain.checkpoint import writer
from pipetrain.build import _truncate_metrics, build_trainer
from pipetrain.checkpoint.read import read_manifest, verify_files
from pipetrain.checkpoint.save import Checkpointer
from pipetrain.checkpoint.writer import CheckpointSaveError
from pipetrain.config import ConfigError, DataConfig, Recipe, RunConfig, TrainConfig, load_recipe
from pipetrain.rerun import SavedRun, finished_report
from pipetrain.data import Loader, PackedData
from pipetrain.models import build, materialize
from pipetrain.optim.build import build_optimizer
from pipetrain.parallel.mesh.dims import ParallelDims
from tests.e2e.common import SMALL, TINY
from tests.unit.common import LLAMA, ModelState


def test_torn_metrics_line_is_cut_back_with_a_warning(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2, 3)]
    path.write_text("\n".join(lines) + "\n" + '{"step": 4, "lo')  # killed mid-write
    _truncate_metrics(str(path), 2)
    assert path.read_text() == "\n".join(lines[:2]) + "\n"
    assert "line 4 is not a complete JSON record" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ['{"step": "x"}', '{"a": ' * 100_000 + "1" + "}" * 100_000],
                         ids=["string-step", "nested-deep"])
def test_a_damaged_metrics_line_is_cut_back_like_a_torn_one(tmp_path, capsys, bad):
    """A string step was a TypeError and a deeply nested line a RecursionError: the resume stopped there."""
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2)]
    path.write_text("\n".join(lines) + "\n" + bad + "\n")
    assert _truncate_metrics(str(path), 2) == 2
    assert path.read_text() == "\n".join(lines) + "\n"
    assert "line 3 is not a complete JSON record" in capsys.readouterr().err


def test_complete_metrics_lines_past_the_step_are_dropped_silently(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    _truncate_metrics(str(path), 3)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]
    assert capsys.readouterr().err == ""


@pytest.fixture
def saver(tmp_path):
    """A Checkpointer and what it saves (one process, the small model), one step saved."""
    recipe = load_recipe(TINY, SMALL + [f"run.output_dir={tmp_path}"])
    dims = ParallelDims.init(recipe.parallel)
    model = materialize(build(recipe.model, device="meta"), recipe.model, recipe.train.seed, dims.device)
    trainer = ModelState(model, build_optimizer(model, dims, recipe.train), dims, 1, {"samples": 8})
    ckpt = Checkpointer(str(tmp_path), recipe, dims)
    ckpt.save(trainer)
    trainer.step = 2
    return ckpt, trainer, tmp_path / "checkpoints"


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device", args[1] if len(args) > 1 else None)


@pytest.mark.parametrize("target", ["save_file", "seal"])  # a rank's tensor file; rank 0's manifest phase
def test_an_oserror_during_a_save_keeps_the_previous_checkpoint(saver, monkeypatch, target):
    ckpt, trainer, root = saver
    monkeypatch.setattr(writer, target, _no_space)
    with pytest.raises(CheckpointSaveError, match=r"No space left on device \(.* MB free\)") as info:
        ckpt.save(trainer)
    assert "\n" not in str(info.value) and str(root) in str(info.value)
    assert sorted(os.listdir(root)) == ["latest", "step-00000001"]  # the temporary folder is gone
    assert (root / "latest").read_text().strip() == "step-00000001"
    verify_files(str(root / "step-00000001"), read_manifest(str(root / "step-00000001")))


def test_a_corpus_without_validation_windows_skips_evaluation_and_refuses_eval_only(tmp_path, capsys):
    """A held-out share shorter than one window (here the last 10% of one 100-token document, with seq_len 16)
    gives no validation window: evaluating would log a loss of 0 over 0 tokens, which reads as a perfect
    score. Periodic evaluation is skipped with one warning and --eval-only is refused with the fix."""
    recipe = Recipe(model=LLAMA, train=TrainConfig(steps=2, global_batch=2, seq_len=16, warmup_steps=1),
                    data=DataConfig(val_fraction=0.1),
                    run=RunConfig(output_dir=str(tmp_path), eval_every=1, progress=False))
    tokens = np.random.default_rng(0).integers(0, LLAMA.vocab_size, 100).astype(np.int32)
    data = PackedData(tokens, None, 16, 0.1, 0, documents=np.array([0, len(tokens)]))  # one document
    assert data.num_val_windows == 0
    trainer = build_trainer(recipe, loader=Loader(data, 2, 0, 1))
    assert "no validation window" in capsys.readouterr().err
    trainer.fit()
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records if "loss" in r] == [1, 2] and not any("eval_loss" in r for r in records)
    with pytest.raises(ConfigError, match=r"--eval-only: the data holds no validation window.*raise data.val_fraction"):
        build_trainer(recipe, loader=Loader(data, 2, 0, 1), eval_only=True)


def test_a_finished_runs_report_skips_damaged_metrics_lines(tmp_path):
    """Launching a finished run again reports its final loss from metrics.jsonl; a line with a string step or a
    string loss, or nested 100k deep, was a TypeError or RecursionError there, and is passed over now."""
    lines = [json.dumps({"step": 1, "loss": 2.5}), json.dumps({"step": "x", "loss": 1.0}),
             json.dumps({"step": 2, "loss": "low"}), '{"a": ' * 100_000 + "1" + "}" * 100_000]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    recipe = Recipe(run=RunConfig(output_dir=str(tmp_path)))
    line = finished_report(SavedRun(str(tmp_path / "checkpoints" / "step-00000002"), 2, {}), recipe)
    assert "final loss 2.5000 at step 1" in line
