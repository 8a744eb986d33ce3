"""Relaxed synchronisation across replicas under injected stragglers (docs/relaxed_sync.md).

4 gloo processes, each its own replica (dp_replicate 4, dp_shard 1, zero 0), of a small llama on
synthetic tokens. Stragglers come from the `faults` section (pipetrain.faults: a slow step sleeps
(factor - 1) x its measured compute), so the injected delays dominate compute:
- transient: every rank slow with probability 0.2 per step, factor 4;
- persistent: rank 3 always slow, factor 2.
For each mode (bsp, ssp s=1 and s=3, dssp 1..3, local_sgd H=4, diloco H=4) the same number of steps
runs from the same start (after an untimed warm-up run), timed from a barrier to the drained end
(drain_replicas, then a barrier): the wall time, its ratio to bsp, the mean bytes one rank sends across
replicas per step (ring all-reduce: 2(n-1)/n of the payload; bsp's is its gradient all-reduce, counted
the same way), seconds waited on peers per step (relaxed modes only) and rank 0's loss over the last 3
steps (same tokens for every mode; a relaxed mode's loss is its replica's).

Usage: python benchmarks/relaxed_sync.py [--steps 24] [--repeats 3] [--scenarios transient persistent]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import torch.distributed as dist
from common import run_ranks

from pipetrain.build import build_trainer
from pipetrain.config import FaultsConfig, ModelConfig, ParallelConfig, Recipe, RunConfig, TrainConfig
from pipetrain.data import Loader, PackedData
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.replicas.wrapped import ring_bytes

CFG = ModelConfig(family="llama", vocab_size=512, d_model=64, n_layers=2, n_heads=4, ffn_hidden=128, max_seq_len=64)
MODES = {
    "bsp": {},
    "ssp s=1": dict(dp_sync="ssp", staleness=1),
    "ssp s=3": dict(dp_sync="ssp", staleness=3),
    "dssp 1..3": dict(dp_sync="dssp", staleness_min=1, staleness=3),
    "local_sgd H=4": dict(dp_sync="local_sgd", sync_every=4),
    "diloco H=4": dict(dp_sync="diloco", sync_every=4),
}
SCENARIOS = {
    "transient": FaultsConfig(slow_ranks=[0, 1, 2, 3], slow_factor=4.0, slow_prob=0.2, seed=1),
    "persistent": FaultsConfig(slow_ranks=[3], slow_factor=2.0, slow_prob=1.0),
}


def _trainer(out, dims, steps, faults, parallel):
    recipe = Recipe(model=CFG, parallel=ParallelConfig(dp_shard=1, **parallel),
                    train=TrainConfig(steps=steps, global_batch=16, seq_len=64, lr=3e-3, min_lr=3e-4, warmup_steps=2,
                                      grad_accumulation_fusion_min_numel=0),
                    run=RunConfig(output_dir=out, progress=False), faults=faults)
    num = 512 * 65
    tokens = (np.arange(num) * 7 % CFG.vocab_size).astype(np.int32)  # a learnable cycle
    data = PackedData(tokens, np.ones(num, dtype=bool), 64, 0.0, 2)
    return build_trainer(recipe, dims, loader=Loader(data, 16, dims.dp_rank, dims.dp))


def _worker(rank, world_size, steps, scenarios, repeats):
    dims = ParallelDims.from_degrees(dp_shard=1)
    out = tempfile.mkdtemp()
    rows = []
    warm = _trainer(out, dims, 2, FaultsConfig(), {})  # untimed: gloo connections, allocator, first-step costs
    for _ in range(2):
        warm.train_step()
    for repeat in range(repeats):  # rounds interleave the modes, so the shared machine's load hits them alike
        for scenario in scenarios:
            for name, parallel in MODES.items():
                trainer = _trainer(out, dims, steps, SCENARIOS[scenario], parallel)
                grad_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
                dist.barrier()
                t0 = time.perf_counter()
                records = [trainer.train_step() for _ in range(steps)]
                trainer.drain_replicas()
                dist.barrier()
                wall = time.perf_counter() - t0
                sent = [r.get("replica_bytes", ring_bytes(grad_bytes, dims.dp_replicate)) for r in records]
                rows.append({"scenario": scenario, "mode": name, "repeat": repeat, "wall": wall,
                             "bytes": sum(sent) / steps, "wait": sum(r.get("wait_s", 0.0) for r in records) / steps,
                             "loss": sum(r["loss"] for r in records[-3:]) / 3})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--repeats", type=int, default=3, help="rounds; the table shows each mode's median")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    runs = run_ranks(4, _worker, args.steps, args.scenarios, args.repeats)
    rows = []
    for scenario in args.scenarios:
        for name in MODES:
            mine = sorted((r for r in runs if r["scenario"] == scenario and r["mode"] == name), key=lambda r: r["wall"])
            rows.append(mine[len(mine) // 2])  # the median round (loss and bytes are the same in every round)
    print(f"4 replicas x 1 rank, {args.steps} steps, {CFG.d_model}-wide {CFG.n_layers}-layer llama, "
          f"median of {args.repeats} rounds")
    print(f"{'scenario':<11} {'mode':<14} {'wall s':>7} {'x bsp':>6} {'KiB sent/step':>14} {'wait s/step':>12} "
          f"{'loss (last 3)':>14}")
    for scenario in args.scenarios:
        base = next(r["wall"] for r in rows if r["scenario"] == scenario and r["mode"] == "bsp")
        for r in (r for r in rows if r["scenario"] == scenario):
            print(f"{scenario:<11} {r['mode']:<14} {r['wall']:7.2f} {r['wall'] / base:6.2f} {r['bytes'] / 1024:14.1f} "
                  f"{r['wait']:12.4f} {r['loss']:14.4f}")


if __name__ == "__main__":
    main()
