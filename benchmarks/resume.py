"""`--resume auto` benchmark: time to choose and load a checkpoint of several GB, and bytes hashed per rank.

    python benchmarks/resume.py --make DIR [--layers 20]   # once: a pp 2 checkpoint of ~3.6 GB in DIR
    python benchmarks/resume.py --time DIR [--reps 3]      # median seconds of --resume auto into pp 2

--make trains one step of a ~300M llama-style model (fp32 weights + 2 AdamW moments: 12 bytes per
parameter) on 2 gloo processes at pp 2 and saves it, so each rank's file holds half of it. --time
rebuilds the same run on 2 processes and times what build_trainer does for `--resume auto`: rank 0
chooses a checkpoint (build._resume_dir) and every rank loads it (build's load_agreed where the code
has it, else pipetrain.checkpoint.load.load), up to a barrier, so the figure is the slowest rank's. It prints the
median of --reps, the median time of the choice alone (rank 1 waits that long in a collective for
rank 0) and the bytes each rank hashed (pipetrain.checkpoint.read.file_sha256 wrapped). The timed
code is whatever pipetrain this checkout holds, so the same command measures old and new code.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
from common import run_ranks

from pipetrain import build
from pipetrain.checkpoint import read as checkpoint_read
from pipetrain.checkpoint.load import load as load_checkpoint
from pipetrain.config import ModelConfig, ParallelConfig, Recipe, RunConfig, TrainConfig
from pipetrain.data import Loader, PackedData
from pipetrain.models import count_params
from pipetrain.parallel.mesh.comm import barrier, sum_over_world_
from pipetrain.parallel.mesh.dims import ParallelDims

MODEL = dict(family="llama", vocab_size=32000, d_model=1024, n_heads=16, n_kv_heads=8, ffn_hidden=2816,
             max_seq_len=64)


def _trainer(out: str, layers: int, dims: ParallelDims):
    """A fresh pp 2 trainer of the ~300M model on fixed random tokens (global batch 2 of 16 tokens)."""
    recipe = Recipe(model=ModelConfig(**MODEL, n_layers=layers),
                    parallel=ParallelConfig(pp=2, microbatches=2),
                    train=TrainConfig(steps=2, global_batch=2, seq_len=16, warmup_steps=1),
                    run=RunConfig(output_dir=out, progress=False))
    tokens = np.random.default_rng(0).integers(0, MODEL["vocab_size"], 64 * 17).astype(np.int32)
    loader = Loader(PackedData(tokens, None, 16, 0.0, 2), 2, dims.dp_rank, dims.dp)
    return recipe, build.build_trainer(recipe, dims, loader=loader)


def _make(rank, world_size, out, layers):
    torch.set_num_threads(1)
    dims = ParallelDims.from_degrees(pp=2)
    _, trainer = _trainer(out, layers, dims)
    trainer.train_step()  # the AdamW moments exist
    path = trainer.checkpointer.save(trainer)
    return count_params(trainer.model), sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def _time(rank, world_size, out, layers, reps):
    """rank 0: (median seconds, every rep's seconds, bytes each rank hashed in one resume)."""
    torch.set_num_threads(1)
    dims = ParallelDims.from_degrees(pp=2)
    recipe, trainer = _trainer(out, layers, dims)
    parts = {"model": trainer.model, "optimizer": trainer.optimizer, "loader": trainer.loader}
    hashed = [0]
    real_hash = checkpoint_read.file_sha256

    def counting_sha256(path):
        hashed[0] += os.path.getsize(path)
        return real_hash(path)

    checkpoint_read.file_sha256 = counting_sha256
    times, chosen = [], []
    for _ in range(reps):
        hashed[0] = 0
        barrier(dims.world_size)
        t0 = time.perf_counter()
        ckpt_dir = build._resume_dir(recipe, dims, "auto")
        chosen.append(time.perf_counter() - t0)  # rank 1: how long it waited in the broadcast for rank 0's choice
        if hasattr(build, "load_agreed"):  # the code under test agrees on per-rank verification
            build.load_agreed(ckpt_dir, lambda path: load_checkpoint(path, parts, recipe, dims), dims, auto=True,
                              output_dir=out)
        else:  # 7c3a3ed: rank 0 hashed every file in _resume_dir, then each rank its own while loading
            load_checkpoint(ckpt_dir, parts, recipe, dims)
        barrier(dims.world_size)
        times.append(time.perf_counter() - t0)
    per_rank = torch.zeros(2, world_size, dtype=torch.float64)  # bytes hashed, median choice wait
    per_rank[:, rank] = torch.tensor([hashed[0], statistics.median(chosen)])
    sum_over_world_(per_rank, world_size)
    return statistics.median(times), times, per_rank[0].tolist(), per_rank[1].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--make", metavar="DIR", help="save the checkpoint into DIR (an empty folder)")
    parser.add_argument("--time", metavar="DIR", help="time --resume auto from DIR's checkpoint")
    parser.add_argument("--layers", type=int, default=20, help="decoder layers (20: ~300M params, ~3.6 GB)")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if args.make:
        os.makedirs(args.make, exist_ok=True)
        params, size = run_ranks(2, _make, args.make, args.layers)
        print(f"saved {params / 1e6:.0f}M params (rank 0's stage) into {args.make}: {size / 1e9:.2f} GB on disk")
    if args.time:
        median, times, hashed, chosen = run_ranks(2, _time, args.time, args.layers, args.reps)
        print(f"--resume auto, 2 processes (pp 2): median {median:.2f} s of {args.reps} "
              f"({', '.join(f'{t:.2f}' for t in times)}); choosing (median, rank 0 / rank 1's wait): "
              f"{chosen[0]:.2f} / {chosen[1]:.2f} s; bytes hashed per rank: "
              f"{', '.join(f'{b / 1e9:.2f} GB' for b in hashed)}", flush=True)


if __name__ == "__main__":
    main()
