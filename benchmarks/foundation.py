"""Foundation benchmark: the CPU's matmul peak, the trainer's overhead against a plain PyTorch loop,
and the tiny recipe's MFU against the measured peak.

    python benchmarks/foundation.py [--steps 12] [--threads 2]

The two training loops run the same model, batches and optimizer settings, alternating step by
step so machine noise hits both alike; the overhead is the ratio of their median step times.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pipetrain.build import build_trainer  # noqa: E402
from pipetrain.config import load_recipe  # noqa: E402
from pipetrain.data import Loader  # noqa: E402
from pipetrain.models import build, count_params, flops_per_token, materialize  # noqa: E402
from pipetrain.optim.build import build_adamw, lr_at, param_groups, set_lr  # noqa: E402


def matmul_tflops(dtype: torch.dtype, n: int = 2048, reps: int = 10) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up: thread pool, packing buffers
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times) / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    fp32 = matmul_tflops(torch.float32)
    bf16 = matmul_tflops(torch.bfloat16)
    print(f"matmul peak (2048^3, {args.threads} threads): fp32 {fp32 * 1e3:.1f} GFLOP/s, bf16 {bf16 * 1e3:.1f} GFLOP/s")

    recipe = load_recipe(os.path.join(ROOT, "recipes", "tiny.yaml"),
                         ["run.output_dir=/tmp/pipetrain-bench-foundation", "run.progress=false"])
    cfg, tcfg = recipe.model, recipe.train
    os.makedirs(recipe.run.output_dir, exist_ok=True)
    trainer = build_trainer(recipe)
    ours = trainer.model

    plain = materialize(build(cfg), cfg, tcfg.seed, "cpu")
    plain_opt = build_adamw(param_groups(plain, tcfg.weight_decay), tcfg)
    plain_loader = Loader(trainer.loader.data, tcfg.global_batch, 0, 1)  # the same batches

    def plain_step() -> float:
        t0 = time.perf_counter()
        batch, _ = plain_loader.next()
        logits = plain(batch.inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten())
        plain_opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), tcfg.grad_clip)
        set_lr(plain_opt, lr_at(1, tcfg))
        plain_opt.step()
        return time.perf_counter() - t0

    ours_t, plain_t = [], []
    for i in range(args.steps + 2):
        o = trainer.train_step()["step_time_s"]
        p = plain_step()
        if i >= 2:  # the first steps pay for allocator warm-up
            ours_t.append(o)
            plain_t.append(p)
    step_tokens = tcfg.global_batch * tcfg.seq_len
    med_o, med_p = statistics.median(ours_t), statistics.median(plain_t)
    fpt = flops_per_token(cfg, tcfg.seq_len)
    print(f"tiny model: {count_params(ours) / 1e6:.2f}M params, {fpt / 1e6:.1f} MFLOP per training token")
    print(f"pipetrain Trainer: median step {med_o:.3f} s = {step_tokens / med_o:.0f} tok/s")
    print(f"plain PyTorch loop: median step {med_p:.3f} s = {step_tokens / med_p:.0f} tok/s")
    print(f"overhead ratio (pipetrain / plain): {med_o / med_p:.3f}")
    print(f"tiny-run MFU against the fp32 peak: {fpt * step_tokens / med_o / (fp32 * 1e12):.1%}")


if __name__ == "__main__":
    main()
