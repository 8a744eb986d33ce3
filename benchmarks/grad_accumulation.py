"""Gradient accumulation fusion: weight gradients added into .grad in place against plain autograd.

Two measurements, one thread, fp32 on the CPU, each case alternating fused / plain so the shared
machine's noise hits both alike:
1. per layer: forward + backward of one microbatch (2 x 128 tokens) through each weight shape of the
   llama that benchmarks/pipeline.py trains (D 256, F 704, 4 of 8 heads for k and v, V 8192) and one
   1024 x 1024 weight, with
   .grad already holding the earlier microbatches' sum, i.e. every microbatch of a step but the first.
   plain = nn.Linear / nn.Embedding (autograd builds dW, then adds it to .grad); fused = pipetrain's
   WeightGradLinear / WeightGradEmbedding with fuse set (pipetrain.parallel.pipeline.weight_grads), here for
   every shape: the table is what the default threshold (train.grad_accumulation_fusion_min_numel) is
   chosen from.
2. a whole step: forward + backward of 8 microbatches of that model through pipetrain's Executor
   (one process, the single-stage schedule), apply_grad_accumulation_fusion at the default threshold
   against fusion off; median step time over --rounds and the paired ratio, plus the largest gradient
   difference between the two.

Usage: python benchmarks/grad_accumulation.py [--rounds 15] [--repeats 30]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import median_seconds  # noqa: E402
from pipetrain.config import TrainConfig  # noqa: E402
from pipetrain.parallel.pipeline.weight_grads import (WeightGradEmbedding, WeightGradLinear,  # noqa: E402
                                                      apply_grad_accumulation_fusion)

TOKENS = (2, 128)
LAYERS = [("q / o (D x D)", 256, 256), ("k, v (D x D/2)", 256, 128), ("gate, up (D -> F)", 256, 704),
          ("down (F -> D)", 704, 256), ("head (D -> V)", 256, 8192),
          ("1024 x 1024 (a 1B model's D x D)", 1024, 1024)]
VOCAB = 8192


def _layer_case(plain: nn.Module, fused: nn.Module, make_input, repeats: int) -> tuple[float, float]:
    fused.load_state_dict(plain.state_dict())
    fused.fuse = True  # every shape, whatever the threshold
    x = make_input()
    dy = torch.randn_like(plain(x))
    for m in (plain, fused):
        for p in m.parameters():
            p.grad = torch.zeros_like(p)  # a later microbatch: .grad already holds a sum

    def run_plain():
        plain(x).backward(dy)

    def run_fused():
        fused(x).backward(dy)

    times = {"plain": [], "fused": []}
    for _ in range(3):
        times["plain"].append(median_seconds(run_plain, repeats, warmup=3))
        times["fused"].append(median_seconds(run_fused, repeats, warmup=3))
    return statistics.median(times["plain"]), statistics.median(times["fused"])


def per_layer(repeats: int) -> None:
    print("| layer (one microbatch, 256 tokens) | plain autograd ms | fused ms | plain / fused |")
    print("|---|---|---|---|")
    for name, d_in, d_out in LAYERS:
        plain, fused = nn.Linear(d_in, d_out, bias=False), WeightGradLinear(d_in, d_out, bias=False)
        t_plain, t_fused = _layer_case(plain, fused, lambda: torch.randn(*TOKENS, d_in, requires_grad=True), repeats)
        print(f"| {name} | {t_plain * 1e3:.2f} | {t_fused * 1e3:.2f} | {t_plain / t_fused:.2f} |", flush=True)
    plain, fused = nn.Embedding(VOCAB, 256), WeightGradEmbedding(VOCAB, 256)
    t_plain, t_fused = _layer_case(plain, fused, lambda: torch.randint(0, VOCAB, TOKENS), repeats)
    print(f"| embedding (V x D) | {t_plain * 1e3:.2f} | {t_fused * 1e3:.2f} | {t_plain / t_fused:.2f} |", flush=True)


def whole_step(rounds: int) -> None:
    from benchmarks.pipeline import CFG, NUM_MB, SEED, _batch
    from pipetrain.config import ParallelConfig
    from pipetrain.models import build, materialize
    from pipetrain.parallel.mesh.dims import ParallelDims
    from pipetrain.parallel.pipeline.executor import Executor
    from pipetrain.parallel.pipeline.stage import build_stage
    from pipetrain.parallel.pipeline.schedules import build_schedule
    from pipetrain.trainer import loss_sum

    dims = ParallelDims.from_degrees()
    model, chunks, specs = build_stage(build(CFG), dims, ParallelConfig(microbatches=NUM_MB), CFG.max_seq_len)
    materialize(model, CFG, SEED, "cpu")
    batch = _batch()
    micro = batch.split(NUM_MB)
    executor = Executor(chunks, specs, dims, (micro[0].inputs.shape[0], CFG.max_seq_len, CFG.d_model),
                        torch.float32, loss_fn=loss_sum)
    actions = build_schedule("1f1b", 0, 1, NUM_MB)

    def step(fuse: bool):
        model.zero_grad(set_to_none=True)
        apply_grad_accumulation_fusion(model, TrainConfig().grad_accumulation_fusion_min_numel if fuse else None)
        t0 = time.perf_counter()
        executor.run(actions, micro, batch.targets.numel())
        return time.perf_counter() - t0, {n: p.grad.clone() for n, p in model.named_parameters()}

    step(True), step(False)  # warm-up
    times = {True: [], False: []}
    ratios = []
    for r in range(rounds):
        order = (True, False) if r % 2 else (False, True)
        got = {fuse: step(fuse) for fuse in order}
        for fuse in order:
            times[fuse].append(got[fuse][0])
        ratios.append(got[False][0] / got[True][0])
    diff = max(float((got[True][1][n] - got[False][1][n]).abs().max()) for n in got[True][1])
    scale = max(float(g.abs().max()) for g in got[False][1].values())
    tokens = batch.targets.numel()
    print(f"\nwhole step, one process: {NUM_MB} microbatches x {TOKENS[0]} x {TOKENS[1]} tokens, median of {rounds}")
    print("| fusion | step s | tokens/s |")
    print("|---|---|---|")
    for fuse in (False, True):
        med = statistics.median(times[fuse])
        print(f"| {'on' if fuse else 'off'} | {med:.3f} | {tokens / med:.0f} |")
    ratios.sort()
    print(f"speed-up (off / on step time, paired per round): median {statistics.median(ratios):.3f}, "
          f"range {ratios[0]:.3f}-{ratios[-1]:.3f}; largest gradient difference {diff:.1e} (largest gradient {scale:.1e})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    per_layer(args.repeats)
    whole_step(args.rounds)


if __name__ == "__main__":
    main()
