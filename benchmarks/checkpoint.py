"""Checkpoint benchmark: save and load time, and bytes written per rank, on CPU.

    python benchmarks/checkpoint.py [--reps 3]

For the tiny recipe's model (~10M) and a ~100M llama-style model, in one process and at dp2 zero1
(2 gloo processes, each writing its optimizer shard): median save time (write + fsync + SHA-256 +
rename), median load time (manifest, checksum verification of every file, slice reads), and the bytes
each rank wrote. The load is repeated with checkpoint.verify=false to show what verification costs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from common import run_ranks

from pipetrain import checkpoint
from pipetrain.config import build_recipe
from pipetrain.data import Loader, PackedData
from pipetrain.models import build, count_params, materialize
from pipetrain.optim import build_optimizer
from pipetrain.parallel.dims import ParallelDims

MODELS = {
    "tiny (recipes/tiny.yaml)": dict(family="llama", vocab_size=8192, d_model=256, n_layers=8, n_heads=8,
                                     n_kv_heads=4, ffn_hidden=704, max_seq_len=256),
    "~100M llama": dict(family="llama", vocab_size=32000, d_model=640, n_layers=12, n_heads=10, n_kv_heads=5,
                        ffn_hidden=1728, max_seq_len=256),
}


class _State:
    """What Checkpointer.save reads from a Trainer."""

    def __init__(self, model, optimizer, loader):
        self.model, self.optimizer, self.loader, self.step, self.tokens_seen = model, optimizer, loader, 1, 0


def _bench(rank, world_size, model_kw, zero, reps, out_dir):
    """(params, median save s, median load s, median unverified load s, bytes this rank wrote)."""
    torch.set_num_threads(1 if world_size > 1 else 2)
    recipe = build_recipe({"model": model_kw, "parallel": {"zero": zero}, "data": {"path": "x", "tokenizer": "y"},
                           "checkpoint": {"keep": 1}})
    dims = ParallelDims.init(recipe.parallel)
    model = materialize(build(recipe.model), recipe.model, 0, "cpu")
    optimizer = build_optimizer(model, dims, recipe.train, zero)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.reduce_grads()
    optimizer.step(1e-4)  # moments exist
    data = PackedData(torch.arange(10_000).numpy() % 100, torch.ones(10_000, dtype=torch.bool).numpy(), 16, 0.0, 0)
    state = _State(model, optimizer, Loader(data, 8, dims.dp_rank, dims.dp))
    ckpt = checkpoint.Checkpointer(out_dir, recipe, dims)
    saves, loads, loads_noverify = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        path = ckpt.save(state)
        saves.append(time.perf_counter() - t0)
        for verify, times in ((True, loads), (False, loads_noverify)):
            r = build_recipe({"model": model_kw, "parallel": {"zero": zero}, "data": {"path": "x", "tokenizer": "y"},
                              "checkpoint": {"verify": verify}})
            t0 = time.perf_counter()
            checkpoint.load(path, {"model": model, "optimizer": optimizer, "loader": state.loader}, r, dims)
            times.append(time.perf_counter() - t0)
        state.step += 1
    written = os.path.getsize(os.path.join(path, f"rank-{rank:05d}.safetensors"))
    return (count_params(model), statistics.median(saves), statistics.median(loads),
            statistics.median(loads_noverify), written)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    print("| model | layout | params | save s | load s (verified) | load s (no verify) | bytes written by rank 0 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, kw in MODELS.items():
        for layout, world, zero in (("1 process", 1, 0), ("dp2 zero1", 2, 1)):
            with tempfile.TemporaryDirectory() as tmp:
                if world == 1:
                    n, save, load, load_nv, written = _bench(0, 1, kw, zero, args.reps, tmp)
                else:
                    n, save, load, load_nv, written = run_ranks(world, _bench, kw, zero, args.reps, tmp)
            print(f"| {label} | {layout} | {n / 1e6:.1f}M | {save:.2f} | {load:.2f} | {load_nv:.2f} | "
                  f"{written / 1e6:.1f} MB |", flush=True)


if __name__ == "__main__":
    main()
