"""Parameter server for the input embedding vs all-reduce (docs/benchmarks.md).

    python benchmarks/ps.py [--rounds 2] [--steps 12] [--vocab 128000]

An untied model with a 128k vocabulary (d_model 256, 2 layers, seq 128, global batch 8) trains on the
shipped corpus through train.py under torchrun, in three layouts, alternated round by round:
  allreduce   dp 2, every worker holds the table and all-reduces its dense V x d gradient;
  ps-bsp      dp 2 + 1 server (parallel.ps_servers=1), bulk-synchronous;
  ps-async    dp 2 + 1 server, ps_sync async.
Per layout: rank 0's peak RSS (a worker), median tokens/s over the steps after the second, and bytes a
worker sends per step: the dense gradient all-reduce (ring, 2 ranks: each sends the gradient's size once)
plus, with servers, the pull and push bytes the trainer logs (ps_pull_bytes, ps_push_bytes: U unique
rows of d fp32 plus their ids). Measured on CPU with gloo; three processes share the machine's cores.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from common import ROOT

from pipetrain.config import ModelConfig
from pipetrain.models import build, count_params

LAYOUTS = {"allreduce": (2, []), "ps-bsp": (3, ["parallel.ps_servers=1"]),
           "ps-async": (3, ["parallel.ps_servers=1", "parallel.ps_sync=async"])}


def _model_sets(vocab: int) -> list[str]:
    return [f"model.vocab_size={vocab}", "model.d_model=256", "model.n_layers=2", "model.n_heads=4",
            "model.n_kv_heads=2", "model.ffn_hidden=1024", "model.max_seq_len=128", "model.tie_embeddings=false"]


def _run(nproc: int, extra: list[str], vocab: int, steps: int, cache: str) -> list[dict]:
    out = tempfile.mkdtemp()
    sets = _model_sets(vocab) + [
        "train.seq_len=128", "train.global_batch=8", f"train.steps={steps}", "train.warmup_steps=2",
        "parallel.dp=2", "run.eval_every=0", "run.sample_tokens=0", "run.progress=false", "checkpoint.every=0",
        f"run.output_dir={out}", f"data.cache_dir={cache}", "train.grad_accumulation_fusion_min_numel=0"] + extra
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(ROOT, "train.py"), "--recipe", os.path.join(ROOT, "recipes", "tiny.yaml")]
    cmd += [a for s in sets for a in ("--set", s)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(extra) or 'allreduce'} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=128000)
    args = ap.parse_args()
    cfg = ModelConfig(family="llama", vocab_size=args.vocab, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                      ffn_hidden=1024, max_seq_len=128, tie_embeddings=False)
    total = count_params(build(cfg, device="meta"))
    table = args.vocab * cfg.d_model
    cache = tempfile.mkdtemp()
    results = {name: [] for name in LAYOUTS}
    for r in range(args.rounds):
        for name, (nproc, extra) in LAYOUTS.items():
            results[name].append(_run(nproc, extra, args.vocab, args.steps, cache))
            print(f"round {r + 1} {name} done", flush=True)
    print(f"\nmodel: {total:,} parameters, input table V x d = {args.vocab:,} x {cfg.d_model} = {table:,} "
          f"({table * 4 / 2**20:.0f} MiB fp32)")
    print("| layout | worker peak RSS | tokens/s (median) | bytes sent per worker per step | of which the table |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, runs in results.items():
        records = [rec for run in runs for rec in run[2:]]
        tps = statistics.median(rec["tokens_per_sec"] for rec in records)
        rss = max(rec["peak_mem_bytes"] for rec in records) / 2**20
        if name == "allreduce":
            dense, rows = total * 4, table * 4
        else:
            rows = statistics.median(rec["ps_pull_bytes"] + rec["ps_push_bytes"] for rec in records)
            dense = (total - table) * 4 + rows
        print(f"| {name} | {rss:,.0f} MiB | {tps:,.0f} | {dense / 2**20:,.1f} MiB | {rows / 2**20:,.2f} MiB |")
    unique = [rec["ps_pull_bytes"] for run in results["ps-bsp"] for rec in run[2:]]
    u = statistics.median(unique) / (cfg.d_model * 4 + 8)
    print(f"\nrows a worker pulls per step: U ~ {u:,.0f} of V = {args.vocab:,}: U x d = {u * cfg.d_model:,.0f} "
          f"values vs V x d = {table:,} ({table / (u * cfg.d_model):,.0f}x fewer)")


if __name__ == "__main__":
    main()
