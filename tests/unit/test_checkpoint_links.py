"""Links inside a checkpoint are refused; rotation and resume see real step folders only, and an output
folder that is itself a link (to a scratch disk) works as any other (docs/checkpoints.md, guarantees)."""
from __future__ import annotations

import os
import shutil

import pytest

from pipetrain.checkpoint.load import find_resumable
from pipetrain.checkpoint.read import CorruptCheckpoint, read_manifest
from pipetrain.checkpoint.save import Checkpointer
from pipetrain.checkpoint.tools import main as ckpt_main
from pipetrain.config import load_recipe
from pipetrain.parallel.mesh.dims import ParallelDims
from tests.e2e.common import TINY
from tests.unit.short_run import short_run


@pytest.fixture
def run(tmp_path):
    """A copy of the short run's folder: checkpoints step-00000003 and step-00000006."""
    out, _, _ = short_run()
    shutil.copytree(out, tmp_path / "run")
    return tmp_path / "run"


def test_a_shard_linked_to_a_file_elsewhere_is_refused_by_every_reader(run, tmp_path, capsys):
    step = run / "checkpoints" / "step-00000006"
    shard = step / "rank-00000.safetensors"
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.move(shard, elsewhere)
    os.symlink(elsewhere, shard)  # the same bytes: only the link gives it away
    with pytest.raises(CorruptCheckpoint, match="rank-00000.safetensors is a symbolic link"):
        read_manifest(str(step))
    for argv in (["inspect", str(step)], ["consolidate", str(step), str(tmp_path / "full")]):
        assert ckpt_main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is a symbolic link" in err[0], err
    assert find_resumable(str(run)) == str(run / "checkpoints" / "step-00000003")  # skipped, with a warning


def test_a_step_folder_that_is_a_link_is_never_resumed_counted_or_deleted_through(run, tmp_path):
    root = run / "checkpoints"
    outside = tmp_path / "outside-step"
    shutil.copytree(root / "step-00000006", outside)
    os.symlink(outside, root / "step-00000009")  # newer by name than every real one
    with pytest.raises(CorruptCheckpoint, match="step-00000009 is a symbolic link"):
        read_manifest(str(root / "step-00000009"))
    assert find_resumable(str(run)) == str(root / "step-00000006")
    recipe = load_recipe(TINY, [f"run.output_dir={run}", "checkpoint.keep=1"])
    Checkpointer(str(run), recipe, ParallelDims()).writer._rotate(9)
    assert sorted(os.listdir(root)) == ["latest", "step-00000006", "step-00000009"], os.listdir(root)
    assert os.listdir(outside)  # nothing deleted through the link


def test_an_output_folder_that_is_a_link_works(run, tmp_path):
    scratch = tmp_path / "scratch"
    shutil.move(run / "checkpoints", scratch)
    os.symlink(scratch, run / "checkpoints")
    assert find_resumable(str(run)) == str(run / "checkpoints" / "step-00000006")
    read_manifest(str(run / "checkpoints" / "step-00000006"))
