"""Loss after equal tokens for each parallel.dp_sync mode on the tiny recipe (docs/benchmarks.md).

    python benchmarks/relaxed_loss.py [--steps 40] [--modes bsp ssp1 ssp3 dssp local_sgd4 diloco4]

train.py runs recipes/tiny.yaml under torchrun with 4 processes, each its own replica (parallel.dp_shard 1),
for the same number of steps (so the same tokens: steps x 16 sequences x 256), no injected faults. The
figures are the final eval loss (after the end-of-run checkpoint brought the replicas to one state) and the
mean train loss of the last 3 steps (a relaxed mode's train loss is its replica's). The learning-rate
schedule is the recipe's, scaled to --steps.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from common import ROOT

MODES = {
    "bsp": [],
    "ssp1": ["parallel.dp_sync=ssp", "parallel.staleness=1"],
    "ssp3": ["parallel.dp_sync=ssp", "parallel.staleness=3"],
    "dssp": ["parallel.dp_sync=dssp", "parallel.staleness_min=1", "parallel.staleness=3"],
    "local_sgd4": ["parallel.dp_sync=local_sgd", "parallel.sync_every=4"],
    "diloco4": ["parallel.dp_sync=diloco", "parallel.sync_every=4"],
}


def _run(mode: str, steps: int, tmp: str) -> dict:
    out = os.path.join(tmp, mode)
    sets = [f"train.steps={steps}", "parallel.dp_shard=1", f"run.output_dir={out}", "run.eval_every=0",
            "run.sample_tokens=0", "run.progress=false", f"data.cache_dir={os.path.join(tmp, 'cache')}"] + MODES[mode]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           os.path.join(ROOT, "train.py"), "--recipe", os.path.join(ROOT, "recipes", "tiny.yaml")]
    cmd += [a for s in sets for a in ("--set", s)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    losses = [r["loss"] for r in records if "loss" in r]
    bytes_sent = [r.get("replica_bytes") for r in records if "loss" in r]
    return {"eval": [r["eval_loss"] for r in records if "eval_loss" in r][-1], "train": sum(losses[-3:]) / 3,
            "tokens": max(r.get("tokens", 0) for r in records),
            "kib": (sum(b for b in bytes_sent if b is not None) / len(bytes_sent) / 1024
                    if any(b is not None for b in bytes_sent) else None)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = {mode: _run(mode, args.steps, tmp) for mode in args.modes}
    print(f"recipes/tiny.yaml, 4 replicas x 1 process, {args.steps} steps each")
    print("| mode | tokens | final eval loss | train loss, last 3 steps | KiB sent across replicas / step |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for mode, r in rows.items():
        kib = "-" if r["kib"] is None else f"{r['kib']:.1f}"
        print(f"| {mode} | {r['tokens']:,} | {r['eval']:.4f} | {r['train']:.4f} | {kib} |")


if __name__ == "__main__":
    main()
