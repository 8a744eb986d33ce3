"""Checkpoint benchmark: save and load time, and bytes written per rank, on CPU.

    python benchmarks/checkpoint.py [--reps 3]
    python benchmarks/checkpoint.py --stall [--reps 5]

For the tiny recipe's model (~10M) and a ~100M llama-style model, in one process and at dp2 zero1
(2 gloo processes, each writing its optimizer shard): median save time (write + fsync + SHA-256 +
rename), median load time (manifest, checksum verification of every file, slice reads), and the bytes
each rank wrote. The load is repeated with checkpoint.verify=false to show what verification costs.

--stall: the training stall per save of the ~100M model in one process, synchronous against
checkpoint.async (the time save() holds the training thread: the whole write, or the host snapshot),
with the background write's own duration; saves alternate between the modes, medians of --reps.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from common import run_ranks

from pipetrain.checkpoint.load import load as load_checkpoint
from pipetrain.checkpoint.save import Checkpointer, owned_tensors
from pipetrain.config import build_recipe
from pipetrain.data import Loader, PackedData
from pipetrain.models import build, count_params, materialize
from pipetrain.optim.build import build_optimizer
from pipetrain.parallel.mesh.dims import ParallelDims

MODELS = {
    "tiny (recipes/tiny.yaml)": dict(family="llama", vocab_size=8192, d_model=256, n_layers=8, n_heads=8,
                                     n_kv_heads=4, ffn_hidden=704, max_seq_len=256),
    "~100M llama": dict(family="llama", vocab_size=32000, d_model=640, n_layers=12, n_heads=10, n_kv_heads=5,
                        ffn_hidden=1728, max_seq_len=256),
}


class _State:
    """What a Trainer hands Checkpointer.save (pipetrain.checkpoint.save.Saveable), without a Trainer."""

    def __init__(self, model, optimizer, loader, dims):
        self.model, self.optimizer, self.loader, self.dims, self.step = model, optimizer, loader, dims, 1

    def checkpoint_state(self, trainable_only: bool):
        return self.step, owned_tensors(self.model, self.optimizer, self.dims), {"tokens": 0,
                                                                                  "data": self.loader.state_dict()}


def _setup(model_kw, zero, extra=None):
    """A recipe, mesh, model and optimizer with AdamW moments, and a stand-in trainer state."""
    recipe = build_recipe({"model": model_kw, "parallel": {"zero": zero}, "data": {"path": "x", "tokenizer": "y"},
                           "checkpoint": {"keep": 1, **(extra or {})}})
    dims = ParallelDims.init(recipe.parallel)
    model = materialize(build(recipe.model), recipe.model, 0, "cpu")
    optimizer = build_optimizer(model, dims, recipe.train, zero)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.reduce_grads()
    optimizer.step(1e-4)  # moments exist
    data = PackedData(torch.arange(10_000).numpy() % 100, torch.ones(10_000, dtype=torch.bool).numpy(), 16, 0.0, 0)
    return recipe, dims, model, optimizer, _State(model, optimizer, Loader(data, 8, dims.dp_rank, dims.dp), dims)


def _stall(model_kw, reps):
    """Median seconds save() holds the caller, sync and async, and the async background write's."""
    torch.set_num_threads(2)
    times = {"sync": [], "async": [], "write": []}
    with tempfile.TemporaryDirectory() as sync_dir, tempfile.TemporaryDirectory() as async_dir:
        _, dims, model, optimizer, state = _setup(model_kw, 0)
        recipes = {mode: build_recipe({"model": model_kw, "data": {"path": "x", "tokenizer": "y"},
                                       "checkpoint": {"keep": 1, "async": mode == "async"}})
                   for mode in ("sync", "async")}
        ckpts = {"sync": Checkpointer(sync_dir, recipes["sync"], dims),
                 "async": Checkpointer(async_dir, recipes["async"], dims)}
        for _ in range(reps):
            for mode in ("sync", "async"):
                t0 = time.perf_counter()
                ckpts[mode].save(state)
                times[mode].append(time.perf_counter() - t0)
                if mode == "async":  # the write runs in the background; here it is waited for before timing on
                    ckpts[mode].wait()
                    times["write"].append(time.perf_counter() - t0)
            state.step += 1
    return count_params(model), {k: statistics.median(v) for k, v in times.items()}


def _bench(rank, world_size, model_kw, zero, reps, out_dir):
    """(params, median save s, median load s, median unverified load s, bytes this rank wrote)."""
    torch.set_num_threads(1 if world_size > 1 else 2)
    recipe, dims, model, optimizer, state = _setup(model_kw, zero)
    ckpt = Checkpointer(out_dir, recipe, dims)
    saves, loads, loads_noverify = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        path = ckpt.save(state)
        saves.append(time.perf_counter() - t0)
        for verify, times in ((True, loads), (False, loads_noverify)):
            r = build_recipe({"model": model_kw, "parallel": {"zero": zero}, "data": {"path": "x", "tokenizer": "y"},
                              "checkpoint": {"verify": verify}})
            t0 = time.perf_counter()
            load_checkpoint(path, {"model": model, "optimizer": optimizer, "loader": state.loader}, r, dims)
            times.append(time.perf_counter() - t0)
        state.step += 1
    written = os.path.getsize(os.path.join(path, f"rank-{rank:05d}.safetensors"))
    return (count_params(model), statistics.median(saves), statistics.median(loads),
            statistics.median(loads_noverify), written)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--stall", action="store_true", help="sync against checkpoint.async stall per save")
    args = parser.parse_args()
    if args.stall:
        n, t = _stall(MODELS["~100M llama"], args.reps)
        print(f"~100M llama ({n / 1e6:.1f}M params, weights + 2 AdamW moments), 1 process, median of {args.reps}")
        print(f"sync save: {t['sync']:.2f} s | async stall (snapshot): {t['async']:.3f} s = "
              f"{t['async'] / t['sync']:.1%} of sync | async background write: {t['write']:.2f} s")
        return
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
