"""Resuming never loses saved work: `--resume auto` over checkpoints that all fail verification refuses (it trained
from step 0 and rotated them away), and `--resume DIR` of another run into a run.output_dir that holds checkpoints
of its own refuses (training on overwrote them); a run's own older checkpoint may still be resumed (a rollback)."""
import hashlib
import os

import pytest

from pipetrain.config import ConfigError
from tests.unit.common import LLAMA, build_trainer


def _run_with_checkpoint(out, steps=2, every_step=False):
    """A run of `steps` steps that saved at its last step (every_step: at each of them; checkpoint.keep 3)."""
    out.mkdir()
    trainer = build_trainer(LLAMA, str(out), steps=4, learnable=True)
    for step in range(1, steps + 1):
        trainer.train_step()
        if every_step or step == steps:
            trainer.checkpointer.save(trainer)
            trainer.checkpointer.wait()
    return out / "checkpoints" / f"step-{steps:08d}"


def _digest(folder):
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in sorted(os.listdir(folder))}


@pytest.mark.parametrize("damage", ["manifest-missing", "weights-truncated"])
def test_auto_over_checkpoints_that_all_fail_verification_refuses_and_keeps_them(tmp_path, damage):
    ckpt = _run_with_checkpoint(tmp_path / "run")
    if damage == "manifest-missing":
        (ckpt / "manifest.json").unlink()
    else:
        weights = next(ckpt.glob("rank-*.safetensors"))
        weights.write_bytes(weights.read_bytes()[:-100])
    before = _digest(ckpt)
    with pytest.raises(ConfigError, match=r"--resume auto: no intact checkpoint is left in .*checkpoints \(1 failed "
                                          r"verification"):
        build_trainer(LLAMA, str(tmp_path / "run"), steps=4, learnable=True, resume="auto")
    assert _digest(ckpt) == before


def test_auto_with_no_checkpoint_at_all_starts_fresh(tmp_path):
    (tmp_path / "run").mkdir()
    trainer = build_trainer(LLAMA, str(tmp_path / "run"), steps=4, learnable=True, resume="auto")
    assert trainer.step == 0


def test_resume_of_another_run_into_a_folder_with_checkpoints_of_its_own_refuses(tmp_path):
    other = _run_with_checkpoint(tmp_path / "other")
    mine = _run_with_checkpoint(tmp_path / "mine", steps=3)
    before = _digest(mine)
    with pytest.raises(ConfigError, match=r"--resume .*other.*: run.output_dir .*mine already holds checkpoints of "
                                          r"its own up to step 3, at or past this checkpoint's step 2"):
        build_trainer(LLAMA, str(tmp_path / "mine"), steps=4, learnable=True, resume=str(other))
    assert _digest(mine) == before
    # into a new folder it resumes; and a run's own older checkpoint may be resumed (a rollback)
    (tmp_path / "new").mkdir()
    assert build_trainer(LLAMA, str(tmp_path / "new"), steps=4, learnable=True, resume=str(other)).step == 2
    assert build_trainer(LLAMA, str(tmp_path / "other"), steps=4, learnable=True, resume=str(other)).step == 2
    # past the folder's newest (a round trip through another layout, tests/dist/test_zero3.py) nothing is lost
    later = _run_with_checkpoint(tmp_path / "later", steps=4)
    assert build_trainer(LLAMA, str(tmp_path / "mine"), steps=5, learnable=True, resume=str(later)).step == 4


def test_a_resume_that_changes_what_the_weights_compute_says_so(tmp_path, capsys):
    """rope_theta, norm_eps, the router's top-k and the like change no tensor, so a resume may change them on
    purpose (a longer context's rope_theta); it names each in one note."""
    import dataclasses
    ckpt = _run_with_checkpoint(tmp_path / "run")
    capsys.readouterr()
    changed = dataclasses.replace(LLAMA, rope_theta=500000.0)
    build_trainer(changed, str(tmp_path / "run"), steps=4, learnable=True, resume=str(ckpt))
    err = capsys.readouterr().err
    assert "note: resuming" in err and "model.rope_theta: 10000.0 there, 500000.0 now" in err, err
    build_trainer(LLAMA, str(tmp_path / "run"), steps=4, learnable=True, resume=str(ckpt))
    assert "note: resuming" not in capsys.readouterr().err


def test_a_rollback_to_an_earlier_step_sets_the_later_checkpoints_aside_and_keeps_its_own_saves(tmp_path):
    """Resumed from step 1 of a run that saved up to step 3: the next save (step 2) sat beside the old step 2 and
    3, rotation by step number deleted the new save, `latest` named a folder that was gone, and `--resume auto`
    (or a relaunch, which said "already finished") took the abandoned step 3. The later ones now move aside, whole."""
    from pipetrain.checkpoint.load import find_resumable
    root = _run_with_checkpoint(tmp_path / "run", steps=3, every_step=True).parent
    old = {n: _digest(root / n) for n in ("step-00000002", "step-00000003")}
    trainer = build_trainer(LLAMA, str(tmp_path / "run"), steps=4, learnable=True, resume=str(root / "step-00000001"))
    trainer.checkpointer.writer.keep = 1
    trainer.train_step()
    trainer.checkpointer.save(trainer)
    trainer.checkpointer.wait()
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-00000002"]  # the new save, kept
    assert (root / "latest").read_text().strip() == "step-00000002"
    assert find_resumable(str(tmp_path / "run")) == str(root / "step-00000002")
    aside = [root / n for n in os.listdir(root) if n.startswith("abandoned-after-step-00000001")]
    assert len(aside) == 1 and {n: _digest(aside[0] / n) for n in sorted(os.listdir(aside[0]))} == old  # intact


def test_rotation_never_deletes_the_save_just_written_for_damaged_later_ones(tmp_path):
    """`--resume auto` falls back past damaged checkpoints and leaves them: rotation kept the newest step numbers,
    so with keep 1 it deleted the save just written and kept a damaged one."""
    root = _run_with_checkpoint(tmp_path / "run", steps=3, every_step=True).parent
    for name in ("step-00000002", "step-00000003"):
        (root / name / "manifest.json").unlink()
    trainer = build_trainer(LLAMA, str(tmp_path / "run"), steps=4, learnable=True, resume="auto")
    assert trainer.step == 1
    trainer.checkpointer.writer.keep = 1
    trainer.train_step()
    trainer.checkpointer.save(trainer)
    trainer.checkpointer.wait()
    assert (root / "step-00000002" / "manifest.json").exists()  # the new save (it replaced the damaged step 2)
    assert not (root / "step-00000001").exists()  # rotated: the newest 1 up to step 2 is kept
