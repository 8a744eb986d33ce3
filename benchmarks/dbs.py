"""Dynamic batch sizing under injected stragglers: static split against DBS (docs/benchmarks.md).

4 gloo processes, each its own replica (dp_replicate 4, dp_shard 1), of a small llama on synthetic
tokens; global batch 32 in microbatches of 1 sample (8 per replica when even), so shares can move in
steps of 1/32. Stragglers come from the `faults` section (a slow step sleeps (factor - 1) x its
measured compute):
- persistent: rank 3 always 2x slower;
- transient: every rank slow with probability 0.2 per step, factor 4;
- transient + ssp s=1: the same, with parallel.dp_sync=ssp, staleness 1.
For each scenario, static and DBS (parallel.dynamic_batch, every 5 steps) run the same steps from the same
start, each step followed by the trainer's agreement as in fit(), timed from a barrier to the drained end.
Rounds interleave static and DBS so the shared machine's load hits them alike; the table shows medians
and the paired median ratio. --plot writes the DBS shares over the steps of the median round.

Usage: python benchmarks/dbs.py [--steps 40] [--repeats 3] [--plot docs/dbs_shares.png]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import torch.distributed as dist
from common import run_ranks

from pipetrain.build import build_trainer
from pipetrain.config import FaultsConfig, ModelConfig, ParallelConfig, Recipe, RunConfig, TrainConfig
from pipetrain.data import Loader, PackedData
from pipetrain.parallel.mesh.dims import ParallelDims

CFG = ModelConfig(family="llama", vocab_size=512, d_model=64, n_layers=2, n_heads=4, ffn_hidden=128, max_seq_len=64)
GLOBAL_BATCH, MICROBATCHES = 32, 8
TRANSIENT = FaultsConfig(slow_ranks=[0, 1, 2, 3], slow_factor=4.0, slow_prob=0.2, seed=1)
SCENARIOS = {
    "persistent 2x": (FaultsConfig(slow_ranks=[3], slow_factor=2.0, slow_prob=1.0), {}),
    "transient": (TRANSIENT, {}),
    "transient+ssp1": (TRANSIENT, dict(dp_sync="ssp", staleness=1)),
}


def _trainer(out, dims, steps, faults, parallel):
    recipe = Recipe(model=CFG, parallel=ParallelConfig(dp_shard=1, microbatches=MICROBATCHES, **parallel),
                    train=TrainConfig(steps=steps, global_batch=GLOBAL_BATCH, seq_len=64, lr=3e-3, min_lr=3e-4,
                                      warmup_steps=2, grad_accumulation_fusion_min_numel=0),
                    run=RunConfig(output_dir=out, progress=False), faults=faults)
    num = 1024 * 65
    tokens = (np.arange(num) * 7 % CFG.vocab_size).astype(np.int32)
    data = PackedData(tokens, np.ones(num, dtype=bool), 64, 0.0, 2)
    return build_trainer(recipe, dims, loader=Loader(data, GLOBAL_BATCH, dims.dp_rank, dims.dp))


def _worker(rank, world_size, steps, scenarios, repeats):
    dims = ParallelDims.from_degrees(dp_shard=1)
    out = tempfile.mkdtemp()
    rows = []
    warm = _trainer(out, dims, 2, FaultsConfig(), {})  # untimed: gloo connections, allocator, first-step costs
    for _ in range(2):
        warm.train_step()
        warm.agree()
    for repeat in range(repeats):
        for scenario in scenarios:
            faults, parallel = SCENARIOS[scenario]
            for mode in ("static", "dbs"):
                extra = dict(dynamic_batch=True, dynamic_batch_every=5) if mode == "dbs" else {}
                trainer = _trainer(out, dims, steps, faults, {**parallel, **extra})
                dist.barrier()
                t0 = time.perf_counter()
                records = []
                for _ in range(steps):
                    records.append(trainer.train_step())
                    trainer.agree()
                trainer.agree(final=True)
                trainer.drain_replicas()
                dist.barrier()
                rows.append({"scenario": scenario, "mode": mode, "repeat": repeat,
                             "wall": time.perf_counter() - t0,
                             "shares": [r.get("dbs_shares") for r in records],
                             "loss": sum(r["loss"] for r in records[-3:]) / 3})
    return rows


def _plot(rows, scenarios, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.2 * len(scenarios), 3.2), sharey=True)
    for ax, scenario in zip(np.atleast_1d(axes), scenarios):
        mine = sorted((r for r in rows if r["scenario"] == scenario and r["mode"] == "dbs"), key=lambda r: r["wall"])
        shares = np.array(mine[len(mine) // 2]["shares"])
        for replica in range(shares.shape[1]):
            ax.step(np.arange(1, len(shares) + 1), shares[:, replica], where="post", label=f"replica {replica}")
        ax.set_title(scenario)
        ax.set_xlabel("step")
    np.atleast_1d(axes)[0].set_ylabel(f"samples of the global batch ({GLOBAL_BATCH})")
    np.atleast_1d(axes)[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3, help="rounds; the table shows medians")
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--plot", default=None, help="write the DBS shares over steps to this PNG")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = run_ranks(4, _worker, args.steps, args.scenarios, args.repeats, timeout_s=3600)
    print(f"4 replicas x 1 rank, {args.steps} steps, global batch {GLOBAL_BATCH} (microbatch 1 sample), "
          f"{CFG.d_model}-wide {CFG.n_layers}-layer llama, median of {args.repeats} rounds")
    print(f"{'scenario':<16} {'static s':>9} {'DBS s':>7} {'DBS/static':>11} {'final DBS shares':>18} "
          f"{'changes':>8} {'loss static':>12} {'loss DBS':>9}")
    for scenario in args.scenarios:
        walls = {m: [r["wall"] for r in sorted(rows, key=lambda r: r["repeat"])
                     if r["scenario"] == scenario and r["mode"] == m] for m in ("static", "dbs")}
        ratio = statistics.median(d / s for d, s in zip(walls["dbs"], walls["static"]))
        dbs = [r for r in rows if r["scenario"] == scenario and r["mode"] == "dbs"]
        med = sorted(dbs, key=lambda r: r["wall"])[len(dbs) // 2]
        changes = sum(a != b for a, b in zip(med["shares"], med["shares"][1:]))
        loss = {m: next(r["loss"] for r in rows if r["scenario"] == scenario and r["mode"] == m)
                for m in ("static", "dbs")}
        print(f"{scenario:<16} {statistics.median(walls['static']):9.2f} {statistics.median(walls['dbs']):7.2f} "
              f"{ratio:11.2f} {str(med['shares'][-1]):>18} {changes:8d} {loss['static']:12.4f} {loss['dbs']:9.4f}")
    if args.plot:
        _plot(rows, args.scenarios, args.plot)


if __name__ == "__main__":
    main()
