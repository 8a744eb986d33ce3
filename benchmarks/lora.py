"""LoRA against full fine-tuning on the finetune recipe's model shape (recipes/finetune-llama.yaml:
SmolLM2-135M, a llama with D 576, F 1536, 9 heads / 3 kv heads, vocab 49152, tied embeddings).

Two tables, one process, fp32 on the CPU:
1. the whole 30-layer model, built on meta (no compute): trainable parameters and the AdamW state
   they need (two fp32 moments each), full fine-tuning against LoRA at --rank on every attention and
   MLP projection (model.lora_targets: []).
2. a timed run of the same shape cut to --layers layers: pipetrain's build_trainer on synthetic
   tokens, --steps optimizer steps of global batch --batch x --seq tokens (2 microbatches); median
   step time after the first step, and the optimizer state bytes the run actually holds
   (optimizer.state_bytes()), alternating full / LoRA rounds so the shared machine's noise hits both.

Usage: python benchmarks/lora.py [--rank 8] [--layers 2] [--steps 6] [--batch 4] [--seq 128] [--rounds 2]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipetrain.config import ModelConfig  # noqa: E402
from pipetrain.models import build  # noqa: E402
from pipetrain.parallel.mesh.dims import ParallelDims  # noqa: E402
from pipetrain.models.lora import count_trainable  # noqa: E402
from pipetrain.parallel.tensor.lora import apply_lora  # noqa: E402
from tests.unit.common import build_trainer  # noqa: E402

SMOLLM2_135M = ModelConfig(family="llama", vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                           ffn_hidden=1536, max_seq_len=2048, tie_embeddings=True)


def _counts(cfg: ModelConfig) -> tuple[int, int]:
    """(trainable parameters, AdamW state bytes) of cfg, counted on meta."""
    model = build(cfg, device="meta")
    apply_lora(model, cfg, ParallelDims(), 0)
    n = count_trainable(model)
    return n, 2 * 4 * n


def _timed(cfg: ModelConfig, args, out: str) -> tuple[list[float], int, int]:
    os.makedirs(out, exist_ok=True)
    trainer = build_trainer(cfg, out, steps=args.steps + 1, global_batch=args.batch, seq_len=args.seq,
                            microbatches=2, lr=1e-4)
    times = []
    for _ in range(args.steps + 1):
        start = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - start)
    return times[1:], count_trainable(trainer.model), trainer.optimizer.state_bytes()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    lora = dict(lora_rank=args.rank, lora_alpha=args.alpha)

    print(f"1. {SMOLLM2_135M.n_layers}-layer SmolLM2-135M shape (counted on meta), LoRA rank {args.rank} on all "
          "7 projections")
    full_n, full_b = _counts(SMOLLM2_135M)
    lora_n, lora_b = _counts(dataclasses.replace(SMOLLM2_135M, **lora))
    print(f"{'':6} {'trainable params':>18} {'AdamW state':>14}")
    print(f"{'full':6} {full_n:>18,} {full_b / 2**20:>11.1f} MiB")
    print(f"{'lora':6} {lora_n:>18,} {lora_b / 2**20:>11.1f} MiB   ({100 * lora_n / full_n:.2f}% of full)")

    shape = dataclasses.replace(SMOLLM2_135M, n_layers=args.layers, max_seq_len=max(args.seq, 64))
    print(f"\n2. the same shape cut to {args.layers} layers: {args.steps} steps of {args.batch} x {args.seq} tokens "
          f"(2 microbatches), fp32, 1 thread, {args.rounds} alternating rounds")
    results = {"full": [], "lora": []}
    held = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, cfg in (("full", shape), ("lora", dataclasses.replace(shape, **lora))):
                times, n, state = _timed(cfg, args, os.path.join(tmp, f"{name}{r}"))
                results[name] += times
                held[name] = (n, state)
    print(f"{'':6} {'trainable params':>18} {'optimizer bytes':>16} {'median step':>12}")
    for name in ("full", "lora"):
        n, state = held[name]
        print(f"{name:6} {n:>18,} {state / 2**20:>12.1f} MiB {statistics.median(results[name]):>10.3f} s")
    ratio = statistics.median(results["lora"]) / statistics.median(results["full"])
    print(f"lora / full step time: {ratio:.2f}")


if __name__ == "__main__":
    main()
