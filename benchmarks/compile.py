"""train.compile on the CPU: step time of eager against compiled transformer blocks, and the compile time.

    python benchmarks/compile.py [--models small tiny moe-tiny] [--steps 8] [--threads 2] [--tp 2]

Per model, two Trainers (train.compile false and true, inductor unless PIPETRAIN_COMPILE_BACKEND says
otherwise) run the same recipe and batches, alternating step by step so the machine's noise hits both
alike. Step time: the median over --steps steps after WARMUP_STEPS (metrics.WARMUP_STEPS, the same rule
as the end-of-run steady-state line). Compile time: the compiled run's first step minus its median step
(the first step traces and compiles every distinct block, forward and backward). The losses of the two
runs are compared (fp32: equal up to inductor's reordering of reductions). --tp 2 runs both on two gloo
processes (one thread each): the compiled blocks then hold the tensor-parallel collectives as functional
collectives (docs/compile.md).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common import run_ranks  # noqa: E402
from pipetrain.build import build_trainer  # noqa: E402
from pipetrain.config import load_recipe  # noqa: E402
from pipetrain.metrics import WARMUP_STEPS  # noqa: E402
from pipetrain.models import count_params  # noqa: E402

# name -> overrides of recipes/tiny.yaml (its corpus and tokenizer)
MODELS = {
    "small": ["model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
              "model.ffn_hidden=128", "model.max_seq_len=32", "train.seq_len=32", "train.global_batch=8"],
    "tiny": [],  # the recipe as shipped: d_model 256, 8 layers, seq 256, 16 sequences a step
    "moe-tiny": [],  # recipes/moe-tiny.yaml as shipped: 8 experts, top 2, d_model 256, 6 layers, seq 256
}
RECIPES = {"moe-tiny": "moe-tiny.yaml"}  # the model's recipe, when not tiny.yaml


def _trainer(name: str, compile_: bool, steps: int, out: str, tp: int):
    sets = MODELS[name] + [f"parallel.tp={tp}", f"train.steps={steps}", f"train.compile={str(compile_).lower()}", f"run.output_dir={out}",
                           "run.progress=false", "run.eval_every=0", "checkpoint.every=0"]
    recipe = load_recipe(os.path.join(ROOT, "recipes", RECIPES.get(name, "tiny.yaml")), sets)
    os.makedirs(out, exist_ok=True)
    return build_trainer(recipe), recipe


def bench(name: str, steps: int, tp: int = 1, out: str | None = None) -> dict:
    total = steps + WARMUP_STEPS
    with tempfile.TemporaryDirectory() as tmp:
        tmp = out or tmp  # under tp every rank writes to rank 0's directory
        eager, recipe = _trainer(name, False, total, os.path.join(tmp, "eager"), tp)
        compiled, _ = _trainer(name, True, total, os.path.join(tmp, "compiled"), tp)
        times = {"eager": [], "compiled": []}
        losses = {"eager": [], "compiled": []}
        for _ in range(total):
            for key, trainer in (("eager", eager), ("compiled", compiled)):
                record = trainer.train_step()
                times[key].append(record["step_time_s"])
                losses[key].append(record["loss"])
    med = {k: statistics.median(v[WARMUP_STEPS:]) for k, v in times.items()}
    tokens = recipe.train.global_batch * recipe.train.seq_len
    return {"name": f"{name} tp{tp}" if tp > 1 else name, "params": count_params(eager.model), "tokens": tokens,
            "eager_s": med["eager"], "compiled_s": med["compiled"],
            "compile_s": times["compiled"][0] - med["compiled"],
            "max_loss_diff": max(abs(a - b) for a, b in zip(losses["eager"], losses["compiled"]))}


def _bench_rank(rank: int, world_size: int, name: str, steps: int, out: str) -> dict:
    return bench(name, steps, world_size, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=8, help="measured steps after the warm-up steps")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel gloo processes (1 thread each)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    backend = os.environ.get("PIPETRAIN_COMPILE_BACKEND") or "inductor"
    print(f"torch {torch.__version__}, backend {backend}, {args.threads} threads, median of {args.steps} steps "
          f"after {WARMUP_STEPS} warm-up steps")
    print("| model | params | tokens/step | eager step s | compiled step s | speedup | compile s | max loss diff |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in args.models:
        if args.tp > 1:
            with tempfile.TemporaryDirectory() as out:
                r = run_ranks(args.tp, _bench_rank, name, args.steps, out, timeout_s=1800)
        else:
            r = bench(name, args.steps)
        print(f"| {r['name']} | {r['params'] / 1e6:.2f}M | {r['tokens']} | {r['eager_s']:.3f} | "
              f"{r['compiled_s']:.3f} | "
              f"{r['eager_s'] / r['compiled_s']:.2f}x | {r['compile_s']:.1f} | {r['max_loss_diff']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
