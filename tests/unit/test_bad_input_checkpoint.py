"""Checkpoint files damaged in ways a checksum of the manifest cannot see, and manifests re-sealed with a fresh
checksum (as a buggy writer would): every reader refuses them in one line (the checkpoint tool's exit 2), at
once, so that --resume auto can skip to an older checkpoint."""
from __future__ import annotations

import json
import os
import re
import shutil
import struct

import numpy as np
import pytest

from pipetrain.build import build_trainer
from pipetrain.checkpoint.manifest import CHECKSUM_KEY, seal
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


def _many_pieces(manifest: dict) -> None:
    """A 1-D tensor of 200,000 pieces of one element each (they tile it: only the overlap check can refuse)."""
    name, info = next((n, i) for n, i in manifest["tensors"].items() if len(i["global_shape"]) == 1)
    file = info["pieces"][0]["file"]
    manifest["tensors"][name] = {**info, "global_shape": [200_000],
                                 "pieces": [{"file": file, "offsets": [i], "shape": [1]} for i in range(200_000)]}
    manifest["tensors"][name]["pieces"][-1].update(offsets=[199_998], shape=[2])  # overlaps the one before it


@pytest.mark.parametrize("edit,message", [
    (lambda m: m["layout"].update(world_size=10 ** 12), r"rng should name a saved file for each of the 10+ ranks"),
    (lambda m: m["layout"].update(ps_servers=10 ** 12), r"rng should name a saved file for each of the 10+1 ranks"),
    (_many_pieces, r"pieces \[199998\] and \[199998\] overlap"),
], ids=["world-size", "ps-servers", "pieces"])
def test_a_resealed_manifest_of_absurd_size_is_refused_at_once(checkpoint, tmp_path, edit, message):
    """Each hung inspect (and every reader): a world size of 1e12 listed every rank's name before comparing, and the
    overlap check compared every pair of a tensor's pieces in Python (2e10 pairs)."""
    case = str(tmp_path / os.path.basename(checkpoint))
    shutil.copytree(checkpoint, case)
    with open(os.path.join(case, "manifest.json")) as f:
        manifest = {k: v for k, v in json.load(f).items() if k != CHECKSUM_KEY}
    edit(manifest)
    with open(os.path.join(case, "manifest.json"), "w") as f:
        json.dump(seal(manifest), f)
    proc = run_script("pipetrain.checkpoint", ["inspect", case], timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert re.search(message, lines[0]), lines
