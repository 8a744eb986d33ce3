"""The save contract (pipetrain.checkpoint.save.Saveable): the Checkpointer writes exactly what it is handed,
(step, items, meta), from a trainer rank and a parameter server alike; a Trainer brings its state to the step
boundary (parameter servers told, relaxed replicas drained) before it hands it over."""
import dataclasses
import os

import pytest
import torch

from pipetrain.checkpoint.read import TensorReader, read_manifest
from pipetrain.checkpoint.save import Checkpointer, owned_tensors
from pipetrain.config import Recipe, RunConfig
from pipetrain.parallel.mesh.dims import ParallelDims
from tests.unit.common import LLAMA, build_trainer


class _Table:
    """A Saveable that is no trainer: one tensor's box of a larger global tensor, and its own meta. (Not under
    model/: a reader checks every model/ tensor against the recipe's model.)"""

    def __init__(self):
        self.rows = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        self.asked: list[bool] = []

    def checkpoint_state(self, trainable_only: bool):
        self.asked.append(trainable_only)
        return 7, [("state/table", self.rows, (3, 4), [0, 0])], {"tokens": 4096, "data": {"samples": 5}}


@pytest.mark.parametrize("lora_rank", [None, 2])
def test_the_checkpointer_writes_what_a_saveable_hands_it(tmp_path, lora_rank):
    recipe = Recipe(model=dataclasses.replace(LLAMA, lora_rank=lora_rank),
                    run=RunConfig(output_dir=str(tmp_path), progress=False))
    table = _Table()
    path = Checkpointer(str(tmp_path), recipe, ParallelDims()).save(table)
    assert table.asked == [lora_rank is not None]  # LoRA saves only what trains: the adapters
    manifest = read_manifest(path)
    assert (manifest["step"], manifest["tokens"], manifest["data"]) == (7, 4096, {"samples": 5})
    assert path.endswith("step-00000007") and list(manifest["tensors"]) == ["state/table"]
    assert torch.equal(TensorReader(path, manifest).read("state/table", [1, 0], [2, 4]), table.rows[1:])


def test_saving_a_step_again_keeps_the_old_copy_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    """A step saved a second time replaces the first copy; a failure before the new folder is in place (here
    its rename) leaves the first copy where `latest` names it, where the old code had already deleted it."""
    import pipetrain.checkpoint.writer as writer
    recipe = Recipe(model=LLAMA, run=RunConfig(output_dir=str(tmp_path), progress=False))
    checkpointer = Checkpointer(str(tmp_path), recipe, ParallelDims())
    path = checkpointer.save(_Table())
    checkpointer.save(_Table())  # the same step again: replaced, nothing left aside
    root = os.path.dirname(path)
    assert sorted(os.listdir(root)) == ["latest", "step-00000007"] and read_manifest(path)["step"] == 7
    real = os.rename
    renames = []

    def rename(src, dst):  # the new folder's move into place fails; setting the old one aside works
        renames.append(os.path.basename(src))
        if os.path.basename(src).startswith(".tmp-"):
            raise OSError(28, "No space left on device")
        real(src, dst)
    monkeypatch.setattr(writer.os, "rename", rename)
    with pytest.raises(Exception):
        checkpointer.save(_Table())
    assert renames == ["step-00000007", ".tmp-step-00000007", ".old-step-00000007"], renames  # aside, fail, back
    assert sorted(os.listdir(root)) == ["latest", "step-00000007"], os.listdir(root)
    assert read_manifest(path)["step"] == 7 and os.listdir(path)


def test_a_step_set_aside_by_a_killed_re_save_is_put_back_before_the_next_launch(tmp_path):
    """Killed between the re-save's two renames, a run leaves the first copy under .old-step-N and no step-N;
    preparing the output folder puts it back (and drops a leftover whose step-N is in place)."""
    from pipetrain.cli import _prepare_output_dir
    recipe = Recipe(model=LLAMA, run=RunConfig(output_dir=str(tmp_path), progress=False))
    path = Checkpointer(str(tmp_path), recipe, ParallelDims()).save(_Table())
    root = os.path.dirname(path)
    os.rename(path, os.path.join(root, ".old-step-00000007"))
    os.makedirs(os.path.join(root, ".old-step-00000003"))  # its step-00000003 ...
    os.makedirs(os.path.join(root, "step-00000003"))  # ... is in place
    _prepare_output_dir(recipe, 0, "auto").release()
    assert sorted(os.listdir(root)) == ["latest", "step-00000003", "step-00000007"], os.listdir(root)
    assert read_manifest(path)["step"] == 7


def test_a_trainer_tells_the_servers_and_drains_replicas_before_it_hands_over_its_state(tmp_path):
    trainer = build_trainer(LLAMA, str(tmp_path), steps=2)
    trainer.train_step()
    calls = []

    class _Servers:  # the PSClient side of a save: only announce_save is part of it
        def announce_save(self, step):
            calls.append(("announce", step))

    trainer.ps = _Servers()
    trainer.optimizer.drain = lambda step, lr_at, grad_clip: calls.append(("drain", step))
    step, items, meta = trainer.checkpoint_state(False)
    assert calls == [("announce", 1), ("drain", 1)] and step == 1
    assert meta == {"tokens": trainer.tokens_seen, "data": trainer.loader.state_dict()}
    expected = owned_tensors(trainer.model, trainer.optimizer, trainer.dims)
    assert [(n, g, o) for n, _, g, o in items] == [(n, g, o) for n, _, g, o in expected]
    assert all(torch.equal(a[1], b[1]) for a, b in zip(items, expected))
