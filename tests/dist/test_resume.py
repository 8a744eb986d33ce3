"""--resume auto on 2 gloo processes at pp 2 (pipetrain.checkpoint.resume): rank 0 chooses without hashing,
each rank hashes exactly the files it reads, and a file that only rank 1 reads, found damaged, sends both
ranks back to the previous checkpoint together (or to one error on every rank when none is left).

Hashing is counted per rank by wrapping pipetrain.checkpoint.read's file_sha256 (bytes per file hashed) and
safe_open (files read), installed after the saves so only the resume is counted.
"""
from __future__ import annotations

import os

import torch.distributed as dist

from pipetrain.checkpoint import read
from pipetrain.config import ConfigError
from pipetrain.parallel.mesh.dims import ParallelDims
from tests.dist.common import replica_trainer
from tests.harness import rank_results

KEYS = dict(steps=6, microbatches=2)


def _count_hashing(hashed: dict, opened: set) -> None:
    """Record, per file (step-N/rank-R.safetensors), the bytes this process hashes and the files it reads."""
    real_hash, real_open = read.file_sha256, read.safe_open

    def name(path):
        return os.path.join(os.path.basename(os.path.dirname(path)), os.path.basename(path))

    def file_sha256(path):
        hashed[name(path)] = hashed.get(name(path), 0) + os.path.getsize(path)
        return real_hash(path)

    def safe_open(path, *args, **kwargs):
        opened.add(name(path))
        return real_open(path, *args, **kwargs)

    read.file_sha256, read.safe_open = file_sha256, safe_open


def _damage(path: str) -> None:
    """Flip the file's last byte (tensor data): its header and size still match, only the hash tells."""
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


def _worker(rank, world_size, out):
    dims = ParallelDims.from_degrees(pp=2)
    trainer = replica_trainer(out, dims, **KEYS)
    losses = {}
    for _ in range(5):  # checkpoints at steps 2 and 4; the run goes on to step 5 (a save changes nothing)
        record = trainer.train_step()
        losses[trainer.step] = record["loss"]
        if trainer.step in (2, 4):
            trainer.checkpointer.save(trainer)
    hashed, opened = {}, set()
    _count_hashing(hashed, opened)

    def resume():
        hashed.clear()
        opened.clear()
        resumed = replica_trainer(out, dims, resume="auto", **KEYS)
        start = resumed.step
        return {"start": start, "loss": resumed.train_step()["loss"], "hashed": dict(hashed), "opened": set(opened)}

    res = {"losses": losses, "intact": resume()}
    dist.barrier()  # test code: the harness's gloo world, no pipetrain collective to stand in for
    if rank == 1:
        _damage(os.path.join(out, "checkpoints", "step-00000004", "rank-00001.safetensors"))
    dist.barrier()
    res["damaged"] = resume()
    dist.barrier()
    if rank == 1:
        _damage(os.path.join(out, "checkpoints", "step-00000002", "rank-00001.safetensors"))
    dist.barrier()
    try:
        resume()
        res["none_left"] = None
    except ConfigError as exc:
        res["none_left"] = str(exc)
    res["sizes"] = {f"{d}/{f}": os.path.getsize(os.path.join(out, "checkpoints", d, f))
                    for d in ("step-00000002", "step-00000004")
                    for f in os.listdir(os.path.join(out, "checkpoints", d)) if f.endswith(".safetensors")}
    return res


def test_resume_auto_hashes_per_rank_and_a_file_only_rank_1_reads_moves_both_ranks_back(tmp_path):
    # a rank that skips the agreement leaves the other in its all-reduce: fail in a minute, not five
    results = rank_results(2, _worker, str(tmp_path), timeout_s=60)
    for rank, res in enumerate(results):
        own4, own2 = f"step-00000004/rank-{rank:05d}.safetensors", f"step-00000002/rank-{rank:05d}.safetensors"
        intact = res["intact"]
        # at pp 2 each stage reads only its own file: rank 0 hashes no byte of rank 1's, nor twice its own
        assert intact["opened"] == {own4}, (rank, intact["opened"])
        assert intact["hashed"] == {own4: res["sizes"][own4]}, (rank, intact["hashed"])
        assert intact["start"] == 4 and intact["loss"] == res["losses"][5]
        damaged = res["damaged"]
        # rank 1 found its step-4 file damaged: both ranks fall back to step 2 and continue it bitwise
        assert damaged["start"] == 2 and damaged["loss"] == res["losses"][3], (rank, damaged["start"])
        assert damaged["hashed"] == {own4: res["sizes"][own4], own2: res["sizes"][own2]}, (rank, damaged["hashed"])
        assert damaged["opened"] == ({own4, own2} if rank == 0 else {own2})  # rank 1 refused its step-4 file
        assert res["none_left"] is not None and "no intact checkpoint is left" in res["none_left"], res["none_left"]
