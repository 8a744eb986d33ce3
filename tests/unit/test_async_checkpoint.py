"""checkpoint.async: save() snapshots to host memory and returns; a background thread writes the same
checkpoint a synchronous save would have written, while training goes on (shown by events: the write is
held until the next step has run); a failed background write raises on the training thread at the next
step boundary and keeps the previous checkpoint latest."""
import errno
import os
import threading

import numpy as np
import pytest
import torch
from safetensors import safe_open

from pipetrain.build import build_trainer
from pipetrain.checkpoint.load import find_resumable
from pipetrain.checkpoint.read import read_manifest
from pipetrain.checkpoint.writer import CheckpointSaveError
from pipetrain.config import (CheckpointConfig, ConfigError, ParallelConfig, Recipe, RunConfig, TrainConfig,
                              build_recipe, load_recipe)
from pipetrain.data import Loader, PackedData
from tests.unit.common import LLAMA

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "tiny.yaml")


def _trainer(out, is_async):
    recipe = Recipe(model=LLAMA, parallel=ParallelConfig(),
                    train=TrainConfig(steps=8, global_batch=4, seq_len=16, lr=1e-2, warmup_steps=1),
                    checkpoint=CheckpointConfig(async_=is_async), run=RunConfig(output_dir=str(out), progress=False))
    os.makedirs(out, exist_ok=True)
    num = 64 * 17
    tokens = np.random.default_rng(0).integers(0, LLAMA.vocab_size, num).astype(np.int32)
    return build_trainer(recipe, loader=Loader(PackedData(tokens, None, 16, 0.0, 2), 4, 0, 1))


def _tensors(ckpt):
    out = {}
    for name in sorted(os.listdir(ckpt)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(ckpt, name), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_the_recipe_key_is_async():
    recipe = load_recipe(TINY, ["checkpoint.async=true"])
    assert recipe.checkpoint.async_ is True and recipe.to_dict()["checkpoint"]["async"] is True
    assert build_recipe(recipe.to_dict()).checkpoint.async_ is True
    with pytest.raises(ConfigError, match="checkpoint.async='yes please' must be bool"):
        load_recipe(TINY, ["checkpoint.async=yes please"])


def test_async_save_overlaps_the_next_step_and_writes_what_a_sync_save_writes(tmp_path, monkeypatch):
    sync = _trainer(tmp_path / "sync", False)
    for _ in range(2):
        sync.train_step()
    sync_dir = sync.checkpointer.save(sync)

    trainer = _trainer(tmp_path / "async", True)
    ckpt = trainer.checkpointer
    release, events = threading.Event(), []
    write = ckpt.writer._write_rank_file

    def held_write(path, snap):  # the writer starts only once the training thread has run the next step
        events.append("write waits")
        assert release.wait(120), "the training thread never let the write go: save() did not return"
        write(path, snap)
        events.append("write ends")

    monkeypatch.setattr(ckpt.writer, "_write_rank_file", held_write)
    for _ in range(2):
        trainer.train_step()
    path = ckpt.save(trainer)
    events.append("save returned")
    trainer.train_step()  # step 3 changes the weights the snapshot was taken from
    events.append("step 3 done")
    assert ckpt.in_flight and not os.path.exists(path)
    release.set()
    ckpt.wait()
    assert events.index("step 3 done") < events.index("write ends")
    assert ckpt.writer.events == [("snapshot", 2), ("written", 2)]
    assert read_manifest(path)["step"] == 2
    a, b = _tensors(sync_dir), _tensors(path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the async checkpoint differs"


def test_a_failed_background_write_raises_at_the_next_step_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path / "run", True)
    ckpt = trainer.checkpointer
    trainer.train_step()
    first = ckpt.save(trainer)
    ckpt.wait()

    def full_disk(path, snap):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(ckpt.writer, "_write_rank_file", full_disk)
    trainer.train_step()
    ckpt.save(trainer)
    ckpt.writer._thread.join()
    trainer.train_step()
    with pytest.raises(CheckpointSaveError, match="No space left on device") as failed:
        trainer.agree()
    root = tmp_path / "run" / "checkpoints"
    assert str(root) in str(failed.value), "the error names where it could not write"
    assert (root / "latest").read_text().strip() == os.path.basename(first)
    assert find_resumable(str(tmp_path / "run")) == first  # intact: its files still verify
    assert not [n for n in os.listdir(root) if n.startswith(".tmp-")]
