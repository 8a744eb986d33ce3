"""Checkpoint files damaged in ways a checksum of the manifest cannot see: every reader refuses them in one
line (the checkpoint tool's exit 2), so that --resume auto can skip to an older checkpoint."""
from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest

from pipetrain.build import build_trainer
from pipetrain.config import ParallelConfig, Recipe, RunConfig, TrainConfig
from pipetrain.data import Loader, PackedData
from tests.harness import run_script
from tests.unit.common import LLAMA


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A one-step checkpoint of the tiny llama, saved in this process."""
    out = tmp_path_factory.mktemp("run")
    recipe = Recipe(model=LLAMA, parallel=ParallelConfig(), train=TrainConfig(steps=1, global_batch=4, seq_len=16),
                    run=RunConfig(output_dir=str(out), progress=False))
    tokens = np.random.default_rng(0).integers(0, LLAMA.vocab_size, 64 * 17).astype(np.int32)
    trainer = build_trainer(recipe, loader=Loader(PackedData(tokens, None, 16, 0.0, 2), 4, 0, 1))
    trainer.train_step()
    return trainer.checkpointer.save(trainer)


def _deep_header(header: dict) -> bytes:
    return b"[" * 50_000 + b"]" * 50_000


def _deep_pieces(header: dict) -> bytes:
    meta = header["__metadata__"]
    return json.dumps({**header, "__metadata__": {k: "[" * 50_000 + "]" * 50_000 for k in meta}}).encode()


@pytest.mark.parametrize("rewrite", [_deep_header, _deep_pieces], ids=["header", "pieces-metadata"])
def test_a_safetensors_header_nested_too_deep_is_one_line(checkpoint, tmp_path, rewrite):
    """The header check (run before any file is hashed) raised RecursionError from json: a traceback from
    every reader, and --resume auto crashed instead of taking the checkpoint before it."""
    case = str(tmp_path / os.path.basename(checkpoint))
    shutil.copytree(checkpoint, case)
    shard = os.path.join(case, sorted(f for f in os.listdir(case) if f.endswith(".safetensors"))[0])
    with open(shard, "rb") as f:
        data = f.read()
    (length,) = struct.unpack("<Q", data[:8])
    header = rewrite(json.loads(data[8:8 + length]))
    with open(shard, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + data[8 + length:])
    proc = run_script("pipetrain.checkpoint", ["inspect", case], timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "has no readable safetensors header (RecursionError" in lines[0], lines
