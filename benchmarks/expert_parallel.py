"""Expert parallelism on CPU with gloo: tokens/s and per-rank memory of an MoE at ep 1/2/4, beside the dense
model of equal active parameters at the same dp.

The MoE (qwen3_moe family: D 128, 4 layers, E 8 experts of F 128, top-2, vocab 2048) and the dense llama
with ffn_hidden = k x F = 256 (so a token passes the same MLP width) train the same global batch (8
sequences of 128 tokens) for --steps steps on ep = dp ranks (one thread each), through
pipetrain.build.build_trainer, as train.py would. Per layout: median tokens/s over the steps after the
first, the parameters a rank holds (an ep rank holds E/ep experts), and its peak resident memory (VmHWM of
rank 0, the torch runtime included: compare rows, not absolute values).

Usage: python benchmarks/expert_parallel.py [--steps 6] [--ep 1 2 4]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import numpy as np
import torch
from common import proc_status_bytes, run_ranks

from pipetrain.build import build_trainer
from pipetrain.config import ModelConfig, ParallelConfig, Recipe, RunConfig, TrainConfig
from pipetrain.data import Loader, PackedData
from pipetrain.parallel.mesh.dims import ParallelDims

MOE = ModelConfig(family="qwen3_moe", vocab_size=2048, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                  max_seq_len=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)
DENSE = ModelConfig(family="llama", vocab_size=2048, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                    max_seq_len=128, ffn_hidden=2 * 128)
BATCH, SEQ = 8, 128


def _train(rank: int, world_size: int, model: ModelConfig, ep: int, steps: int) -> dict:
    torch.set_num_threads(1)
    dims = ParallelDims.from_degrees(dp=world_size, ep=ep)
    with tempfile.TemporaryDirectory() as out:
        recipe = Recipe(model=model, parallel=ParallelConfig(ep=ep),
                        train=TrainConfig(steps=steps, global_batch=BATCH, seq_len=SEQ, lr=1e-3, warmup_steps=1),
                        run=RunConfig(output_dir=out, progress=False))
        num = 64 * (SEQ + 1)
        tokens = np.random.default_rng(0).integers(0, model.vocab_size, num).astype(np.int32)
        loader = Loader(PackedData(tokens, np.ones(num, dtype=bool), SEQ, 0.0, 2), BATCH, dims.dp_rank, dims.dp)
        trainer = build_trainer(recipe, dims, loader=loader)
        params = sum(p.numel() for p in trainer.model.parameters())
        rates = [trainer.train_step()["tokens_per_sec"] for _ in range(steps)]
    return {"tokens_per_s": statistics.median(rates[1:]), "params_per_rank": params,
            "vmhwm_mib": proc_status_bytes("VmHWM") / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"{'model':<6} {'ranks':>5} {'ep':>3} {'tokens/s':>9} {'params/rank':>12} {'VmHWM MiB':>10}")
    for ep in args.ep:
        for name, model, model_ep in (("moe", MOE, ep), ("dense", DENSE, 1)):
            r = run_ranks(ep, _train, model, model_ep, args.steps)  # fresh processes: VmHWM is this layout's
            print(f"{name:<6} {ep:>5} {model_ep:>3} {r['tokens_per_s']:>9.0f} {r['params_per_rank']:>12,} "
                  f"{r['vmhwm_mib']:>10.0f}", flush=True)


if __name__ == "__main__":
    main()
