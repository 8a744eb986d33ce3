"""Tensorwise, rowwise and rowwise_with_gw_hp fp8 scales (train.fp8_recipe, docs/fp8.md): how far each linear's
three GEMMs land from fp64 when a few tokens or a few channels are outliers, and how far each recipe's loss curve
lands from bf16's on the tiny recipe. Accuracy only: on the CPU every recipe is the fp32 emulation, so no speed is
measured here (benchmarks/gpu.py --full has the rowwise rows for a GPU).

    python benchmarks/fp8_scaling.py [--tokens 2048] [--dim 1024] [--no-train] [--out fp8-scaling.md]

Part 1: x (tokens, dim) and dy (tokens, dim) standard normal, W (dim, dim) of std 1/sqrt(dim); then 1% of the
tokens (rows of x and dy) or 1% of the channels (columns of x) scaled by a factor. Each cell is the relative
Frobenius error ||got - exact|| / ||exact|| of y = x W^T, dx = dy W and dW = dy^T x, exact in fp64 from the
unquantised operands, got from pipetrain's fp8 linear under bf16 autocast as training runs it (emulated: fp32
sums of the float8 operands, results rounded to bf16; dy given in bf16, as autocast's y has it), and for
the outlier tokens the error over the other tokens only (what one outlier costs the rest).
Part 2: train.py on the tiny recipe as the end-to-end tests cut it (d 64, 4 layers, 20 steps; tests/e2e), in
bf16 and fp8 under each recipe: each fp8 curve's largest relative distance from bf16's over the steps.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pipetrain.parallel.tensor.fp8 import Fp8Linear  # noqa: E402

FACTORS = (1, 2 ** 4, 2 ** 8, 2 ** 12, 2 ** 16)
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
# tests/e2e/common.py's SMALL, as the fp8 end-to-end tests run the tiny recipe
SMALL = ["train.grad_accumulation_fusion_min_numel=0", "model.d_model=64", "model.n_layers=4", "model.n_heads=4",
         "model.n_kv_heads=2", "model.ffn_hidden=128", "model.max_seq_len=32", "train.seq_len=32",
         "train.global_batch=8", "train.steps=20", "train.warmup_steps=2", "train.lr=3e-3", "run.eval_every=0",
         "run.log_every=1", "run.sample_tokens=0", "run.progress=false"]


def gemm_errors(tokens: int, dim: int, where: str, factor: float, recipe: str) -> tuple[float, ...]:
    """(y, dx, dW, y over the non-outlier tokens) relative errors of one fp8 linear against fp64."""
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(tokens, dim, generator=g), torch.randn(tokens, dim, generator=g)
    w = torch.randn(dim, dim, generator=g) / dim ** 0.5
    picked = torch.randperm(tokens if where == "tokens" else dim, generator=g)[:max(1, tokens // 100)]
    if where == "tokens":
        x[picked] *= factor
        dy[picked] *= factor
    else:
        x[:, picked] *= factor
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as training runs it: bf16 results (and gw_hp's bf16 dW)
        y = Fp8Linear(rowwise=recipe != "tensorwise", weight_grad_hp=recipe == "rowwise_with_gw_hp")(xi, wi)
    y.backward(dy.to(y.dtype))
    xd, wd, dyd = x.double(), w.double(), dy.to(y.dtype).double()  # the gradient as the linear is given it
    exact = (xd @ wd.t(), dyd @ wd, dyd.t() @ xd)
    errs = [((got.double() - want).norm() / want.norm()).item() for got, want in zip((y, xi.grad, wi.grad), exact)]
    rest = torch.ones(tokens, dtype=torch.bool)
    if where == "tokens":
        rest[picked] = False
    errs.append(((y.double()[rest] - exact[0][rest]).norm() / exact[0][rest].norm()).item())
    return tuple(errs)


def part1(tokens: int, dim: int) -> list[str]:
    lines = [f"Part 1: one fp8 linear, {tokens} tokens x {dim} channels, relative error against fp64 "
             "(tensorwise / rowwise / rowwise_with_gw_hp)", "",
             "| outliers | factor | y | dx | dW | y of the other tokens |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for where in ("tokens", "channels"):
        for factor in FACTORS:
            errors = [gemm_errors(tokens, dim, where, factor, recipe) for recipe in RECIPES]
            cells = [" / ".join(f"{e:.2e}" for e in cell) for cell in zip(*errors)]
            if where == "channels":
                cells[3] = "(all)"
            lines.append(f"| 1% of the {where} | {factor:g} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    return lines


def _losses(work: str, name: str, overrides: list[str]) -> list[float]:
    out = os.path.join(work, name)
    sets = SMALL + [f"run.output_dir={out}", f"data.cache_dir={os.path.join(work, 'cache')}"] + overrides
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--recipe", "tiny"] + [a for s in sets for a in ("--set", s)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: train.py exited {proc.returncode}: {proc.stderr[-2000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [m["loss"] for m in map(json.loads, f) if "loss" in m and "step" in m]


def part2() -> list[str]:
    with tempfile.TemporaryDirectory() as work:
        bf16 = _losses(work, "bf16", ["train.precision=bf16"])
        runs = {recipe: _losses(work, recipe, ["train.precision=fp8", f"train.fp8_recipe={recipe}"])
                for recipe in RECIPES}
    lines = ["Part 2: the tiny recipe (d 64, 4 layers, 20 steps, emulated fp8 on the CPU) against bf16", "",
             "| run | first loss | last loss | largest relative distance from bf16 |", "| --- | ---: | ---: | ---: |",
             f"| bf16 | {bf16[0]:.4f} | {bf16[-1]:.4f} | |"]
    for recipe, losses in runs.items():
        dist = max(abs(a - b) / b for a, b in zip(losses, bf16))
        lines.append(f"| fp8 {recipe} | {losses[0]:.4f} | {losses[-1]:.4f} | {dist:.2%} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--no-train", action="store_true", help="part 1 only")
    parser.add_argument("--out", default="fp8-scaling.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    lines = part1(args.tokens, args.dim)
    if not args.no_train:
        lines += ["", *part2()]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
