"""Planner benchmark: predicted vs measured tokens/s and peak memory on this machine, and the plan of a 1.3B model.

    python benchmarks/planner.py [--device plan-profile.json | --calibrate] [--worlds 2 4] [--layouts 12] [--steps 20]
                                 [--rounds 5] [--memory-width 4]

measure: for each world size, the planner's valid layouts of a small llama (D=128, L=4, V=1024, batch 8 x 64)
  are ranked on the device profile; --layouts of them, evenly spread over the ranking (best first), run on gloo
  processes (one thread each) for --steps steps on synthetic tokens, built by pipetrain.build.build_trainer.
  Measured, in two passes with fresh processes each: speed, the median step time after the first step ->
  tokens/s, with the allocator as training runs it, in --rounds rounds (each a fresh set of processes running
  every layout in turn) and the median over rounds reported, so a slow minute of the machine lands on one
  round of every layout rather than on all rounds of one (a single round's layouts moved by up to 25% between
  runs); memory, 3 steps with glibc's mmap threshold pinned (so
  freed tensors go back to the OS and RSS follows live memory; every large allocation then page-faults, which
  doubles step times, hence the separate pass), one fresh set of processes per layout, on the same layouts of
  a --memory-width times wider model (default 4: D 512): peak = the largest over ranks of the peak RSS during
  the steps (VmHWM, reset after the build) minus the RSS before the build. Reported: Spearman rank correlation of
  predicted and measured tokens/s, the planner's top choice against the best measured, memory error per layout.
gpt-1b: the ranked plan of recipes/gpt-1b.yaml (parallel.auto semantics: its fixed keys dropped) on 8 x H100 80GB
  and on 2 nodes x 8, and the memory model next to the figures the ZeRO paper publishes for a 1.5B GPT-2.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pipetrain.build import build_trainer  # noqa: E402
from pipetrain.config import ModelConfig, ParallelConfig, Recipe, RunConfig, TrainConfig, load_recipe  # noqa: E402
from pipetrain.data import Loader, PackedData  # noqa: E402
from pipetrain.parallel.mesh.dims import ParallelDims  # noqa: E402
from pipetrain.plan import format_plan_row, plan_header  # noqa: E402
from pipetrain.plan.calibrate import calibrate, save_profile  # noqa: E402
from pipetrain.plan.devices import DEVICES, load_profile  # noqa: E402
from pipetrain.plan.memory import FP32, activation_bytes, model_state_bytes, rank_memory  # noqa: E402
from pipetrain.plan.search import apply_layout, search  # noqa: E402

MODEL = ModelConfig(family="llama", vocab_size=1024, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                    ffn_hidden=384, max_seq_len=64)
RECIPE = Recipe(model=MODEL, train=TrainConfig(global_batch=8, seq_len=64, lr=1e-3, warmup_steps=1,
                                               grad_accumulation_fusion_min_numel=0))
GIB, MIB = 2 ** 30, 2 ** 20


def _rss(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _memory_recipe(width: int) -> Recipe:
    """The benchmark's model width times wider (heads unchanged): the memory pass runs it, because a process's
    few MiB that no model counts (autograd engine, gloo groups, allocator slack) would swamp the D 128 model's
    10-30 MiB."""
    return dataclasses.replace(RECIPE, model=dataclasses.replace(MODEL, d_model=MODEL.d_model * width,
                                                                 ffn_hidden=MODEL.ffn_hidden * width))


def _worker(rank: int, world_size: int, layouts: list[dict], steps: int, out: str, tag: str,
            width: int = 1) -> None:
    torch.set_num_threads(1)
    rows = []
    # The first layout a process builds pays its page faults, thread pools, lazy imports and kernel warm-up: a
    # warm-up round of the first layout (not reported) keeps that out of the reported rows. The memory pass
    # runs one layout per fresh process (memory an earlier layout freed would hide this one's growth) and warms
    # up on the same layout of a 4x narrower model, whose few MiB return to the OS when it is freed.
    memory = tag.startswith("memory")
    for k, layout in enumerate([layouts[0]] + layouts):
        base = _memory_recipe(width) if memory else RECIPE
        if memory and k == 0:
            base = dataclasses.replace(RECIPE, model=dataclasses.replace(MODEL, d_model=32, ffn_hidden=96))
        recipe = apply_layout(dataclasses.replace(base, train=dataclasses.replace(RECIPE.train, steps=steps),
                                                  run=RunConfig(output_dir=os.path.join(out, f"{tag}run{k}"),
                                                                progress=False)), layout)
        os.makedirs(recipe.run.output_dir, exist_ok=True)
        dims = ParallelDims.from_degrees(dp=layout["dp"], tp=layout["tp"], pp=layout["pp"], world_size=world_size)
        tokens = np.random.default_rng(0).integers(0, MODEL.vocab_size, 64 * 65).astype(np.int32)
        data = PackedData(tokens, np.ones(len(tokens), dtype=bool), 64, 0.0, 0)
        before = _rss()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        trainer = build_trainer(recipe, dims, loader=Loader(data, 8, dims.dp_rank, dims.dp))
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            trainer.train_step()
            times.append(time.perf_counter() - t0)
        rows.append({"step_s": statistics.median(times[1:]) if len(times) > 1 else times[0],
                     "peak": _rss("VmHWM") - before})
        trainer.logger.close()
        del trainer
        gc.collect()
    rows = rows[1:]
    with open(os.path.join(out, f"{tag}{rank}.json"), "w") as f:
        json.dump(rows, f)


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def measure(profile, world: int, num_layouts: int, steps: int, width: int, rounds: int) -> None:
    from tests.harness import run_ranks  # noqa: E402 -- the gloo spawner the tests use
    result = search(RECIPE, world, profile)
    n = len(result.plans)
    picks = sorted({round(i * (n - 1) / (num_layouts - 1)) for i in range(num_layouts)}) if n > 1 else [0]
    plans = [result.plans[i] for i in picks]
    layouts = [p.layout for p in plans]
    with tempfile.TemporaryDirectory() as out:
        for k in range(rounds):
            run_ranks(world, _worker, layouts, steps, out, f"speed{k}_")
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by the spawned interpreters at start
        try:
            for k, layout in enumerate(layouts):
                run_ranks(world, _worker, [layout], 3, out, f"memory{k}_", width)
        finally:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        speed = [[json.load(open(os.path.join(out, f"speed{k}_{r}.json"))) for r in range(world)]
                 for k in range(rounds)]
        memory = [[json.load(open(os.path.join(out, f"memory{k}_{r}.json")))[0] for k in range(len(layouts))]
                  for r in range(world)]
    tokens = RECIPE.train.global_batch * RECIPE.train.seq_len
    per_round = [[tokens / max(r[k]["step_s"] for r in ranks) for ranks in speed] for k in range(len(plans))]
    measured = [statistics.median(values) for values in per_round]
    peaks = [max(r[k]["peak"] for r in memory) for k in range(len(plans))]
    wide = _memory_recipe(width)
    predicted_peaks = [max(r.total for r in rank_memory(apply_layout(wide, p.layout), world, staged_collectives=True))
                       for p in plans]  # gloo on CPU
    print(f"\n## world {world}: {n} valid layouts on {profile.name}; {len(plans)} run ({steps} steps, median of "
          f"{rounds} rounds); memory at D {wide.model.d_model}")
    print("| rank | dp tp pp | schedule v split | mb | zero | recompute | sp | pred tok/s | meas tok/s | "
          "rounds min-max | pred MiB | meas MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for i, (plan, tps, predicted, peak) in enumerate(zip(plans, measured, predicted_peaks, peaks)):
        l = plan.layout
        print(f"| {picks[i] + 1} | {l['dp']} {l['tp']} {l['pp']} | {l['schedule']} {l['virtual_stages']} "
              f"{'y' if l['split_backward'] else '-'} | {l['microbatches']} | {l['zero']} | {l['recompute']} | "
              f"{'y' if l['sequence_parallel'] else '-'} | {plan.time.tokens_per_s:,.0f} | {tps:,.0f} | "
              f"{min(per_round[i]):,.0f}-{max(per_round[i]):,.0f} | {predicted / MIB:.1f} | {peak / MIB:.1f} |")
    best = max(range(len(plans)), key=measured.__getitem__)
    print(f"Spearman(predicted, measured tokens/s) = {spearman([p.time.tokens_per_s for p in plans], measured):.2f}; "
          f"top choice measured {measured[0]:,.0f} tok/s = {measured[0] / measured[best]:.0%} of the best measured "
          f"(rank {picks[best] + 1})")
    if rounds > 1:  # the noise ceiling: how well one round's measurements rank like the median's
        print("Spearman(one round, median of rounds) = "
              + ", ".join(f"{spearman([v[k] for v in per_round], measured):.2f}" for k in range(rounds)))
    errors = [predicted / peak - 1 for predicted, peak in zip(predicted_peaks, peaks) if peak > 0]
    print(f"peak memory: {sum(abs(e) <= 0.15 for e in errors)} of {len(plans)} within 15% of measured; median "
          f"|error| {statistics.median(map(abs, errors)):.0%}; predicted - measured from {min(errors):+.0%} "
          f"to {max(errors):+.0%}")


def gpt_1b(top: int) -> None:
    recipe = load_recipe(os.path.join(ROOT, "recipes", "gpt-1b.yaml"))
    recipe = dataclasses.replace(recipe, parallel=ParallelConfig(auto=True))
    for nodes in (1, 2):
        profile = DEVICES["h100-sxm-80gb"]
        result = search(recipe, 8 * nodes, profile, ranks_per_node=8)
        print(f"\n## recipes/gpt-1b.yaml on {nodes} node(s) x 8 x {profile.name}: {len(result.plans)} layouts fit, "
              f"rejected {result.reasons()}")
        print(plan_header())
        for i, plan in enumerate(result.plans[:top]):
            print(format_plan_row(i + 1, plan))
    # The ZeRO paper (Rajbhandari et al., SC'20, arXiv:1910.02054, sections 3.1 and 3.2): mixed-precision Adam
    # holds 16 bytes per parameter of model states, "at least 24 GB" for a 1.5B GPT-2; its activations at
    # sequence 1K and batch 32 take "about 60 GB". Our fp32 master weights and fp32 gradients (4 + 4 + 8 bytes)
    # also come to 16 bytes per parameter.
    xl = Recipe(model=ModelConfig(family="gpt2", vocab_size=50257, d_model=1600, n_layers=48, n_heads=25,
                                  max_seq_len=1024),
                train=TrainConfig(global_batch=32, seq_len=1024, precision="bf16"))
    params, grads, optim = model_state_bytes(xl, 1, 0)
    acts = activation_bytes(xl, 1, 0, in_flight=1)
    print(f"\n1.5B GPT-2 (d 1600, 48 layers), one GPU, no ZeRO: model states {(params + grads + optim) / 1e9:.1f} GB "
          f"({(params + grads + optim) / (params / FP32):.0f} bytes/param; ZeRO paper: 16 bytes/param, 24 GB); "
          f"activations at 32 x 1024, bf16, no recompute: {acts / 1e9:.1f} GB (ZeRO paper: about 60 GB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="profile JSON (from --calibrate) or a device name")
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument("--worlds", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--layouts", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5, help="speed rounds, each a fresh set of processes running "
                        "every layout; the median is reported")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--memory-width", type=int, default=4, help="the memory pass's model is this many times "
                        "wider (1: the speed pass's model)")
    args = parser.parse_args()
    if args.calibrate or args.device is None:
        profile = calibrate(repeats=10, recipe=RECIPE)
        save_profile(profile, "plan-profile.json")
        print(f"calibrated: {json.dumps(profile.as_dict())}")
    else:
        profile = load_profile(args.device)
    for world in args.worlds:
        measure(profile, world, args.layouts, args.steps, args.memory_width, args.rounds)
    gpt_1b(args.top)


if __name__ == "__main__":
    main()
