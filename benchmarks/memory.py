"""Memory benchmark: ZeRO model-state bytes per rank, activation memory and time under recomputation,
and the bf16 / fp32 step-time ratio on CPU.

    python benchmarks/memory.py [zero] [recompute] [bf16] [modes] [ps-init] [gpu-peaks] [--steps 6] [--threads 1]

zero: gloo processes at dp 2 and 4 (one thread each) train the tiny recipe's model (llama D=256 L=8
  V=8192, 10.1M parameters) for --steps steps at parallel.zero 0, 1, 2 (and 2 without overlap); after reduce_grads of the
  last step each rank counts the bytes it holds of parameters, gradients (stage 2: its reduce-scatter
  buffers, padding included) and AdamW moments, next to the formulas with P = local parameters:
  zero 0: 4P + 4P + 8P; zero 1: 4P + 4P + 8P/dp; zero 2: 4P + 4P/dp + 8P/dp (fp32 parameters are the
  master weights, so there is no separate master copy). Also the median step time.
recompute: one process per (model size, mode): bytes saved for backward (saved_tensors_hooks, unique
  storages, parameters excluded: what activations cost between forward and backward), the peak RSS
  over the measured steps above the RSS before them (VmHWM reset through /proc/self/clear_refs after
  a warm-up step; glibc's mmap threshold is pinned so freed tensors go back to the OS and RSS follows
  live memory; the increase also holds the gradients, the same in every mode), and the median step.
bf16: median step time with train.precision=bf16 (autocast) over fp32, same model, one process.
modes: the one memory model (pipetrain.plan.memory.run_memory, what the pre-flight check, --dry-run and
  parallel.auto report) against measured peaks for the replica and server modes: bsp, ssp (staleness 2),
  diloco (sync_every 2, outer momentum), a parameter server (2 servers, bsp) and dynamic batching (the
  busiest replica given its largest share), each on fresh gloo processes (one thread each; glibc's mmap
  threshold pinned so freed tensors go back to the OS and RSS follows live memory). Each rank first runs the
  same mode on a narrow model (lazy imports, gloo buffers and thread pools out of the figure), then measures
  the real one: peak = VmHWM (reset through /proc/self/clear_refs) during build and --steps steps, minus the
  RSS before the build. Reported per kind of rank: the largest measured over its ranks against the model.
ps-init: a parameter server's peak while it builds its rows of a V=128k, d=1024 table with 2 servers, the
  rows drawn in chunks (today) against drawing the full table and slicing it (before issue 33).
gpu-peaks: the one memory model for a CUDA run (the Triton kernels' path) against the peak allocated memory an
  H200 measured for benchmarks/gpu.py's rows (tests/unit/test_plan_memory_gpu.py holds the figures and bounds
  each ratio), and the model as it counts a CPU run, which it used on every device before. Nothing runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pipetrain.build import build_server, build_trainer  # noqa: E402
from pipetrain.config import ModelConfig, ParallelConfig, Recipe, RunConfig, TrainConfig  # noqa: E402
from pipetrain.data import Loader, PackedData  # noqa: E402
from pipetrain.models import build, count_params, materialize  # noqa: E402
from pipetrain.models.init import init_rows, init_tensor  # noqa: E402
from pipetrain.optim.build import lr_at  # noqa: E402
from pipetrain.parallel.mesh.dims import ParallelDims  # noqa: E402
from pipetrain.parallel.pipeline.recompute import apply_recompute  # noqa: E402
from pipetrain.parallel.data.zero import ZeroOptimizer  # noqa: E402
from pipetrain.parallel.ps.protocol import row_range  # noqa: E402
from pipetrain.plan.memory import rank_memory, run_memory  # noqa: E402
from tests.harness import saved_activation_bytes  # noqa: E402

TINY = ModelConfig(family="llama", vocab_size=8192, d_model=256, n_layers=8, n_heads=8, n_kv_heads=4,
                   ffn_hidden=704, max_seq_len=256)
SIZES = {  # name: (model, batch, seq_len)
    "S": (ModelConfig(family="llama", vocab_size=8192, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4,
                      ffn_hidden=704, max_seq_len=256), 4, 256),
    "M": (ModelConfig(family="llama", vocab_size=8192, d_model=512, n_layers=4, n_heads=8, n_kv_heads=4,
                      ffn_hidden=1408, max_seq_len=512), 4, 512),
}
MIB = 2 ** 20


def _batch(cfg: ModelConfig, batch: int, seq_len: int, seed: int = 0):
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def _model(cfg: ModelConfig, recompute: str = "none"):
    model = materialize(build(cfg), cfg, 1234, "cpu")
    apply_recompute(model, ParallelConfig(recompute=recompute))
    return model


# ---- ZeRO model states ----

def _zero_trainer(zero: int, overlap: bool, dims: ParallelDims, steps: int, out: str):
    """The model and optimizer as a run builds them (the loop below feeds its own batches, not the loader's)."""
    recipe = Recipe(model=TINY, parallel=ParallelConfig(zero=zero),
                    train=TrainConfig(steps=steps, lr=1e-3, warmup_steps=1, global_batch=8, seq_len=64),
                    run=RunConfig(output_dir=out, progress=False))
    os.makedirs(out, exist_ok=True)  # rank 0's metrics file
    tokens = np.zeros(8 * 64 + 1, dtype=np.int32)
    loader = Loader(PackedData(tokens, np.ones(len(tokens), dtype=bool), 64, 0.0, 0), 8, dims.dp_rank, dims.dp)

    def zero_optimizer(model, dims, recipe):
        return ZeroOptimizer(model, dims, recipe.train, zero, overlap=overlap)
    return build_trainer(recipe, dims, loader=loader, optimizer_factory=zero_optimizer if zero else None)


def _zero_worker(rank: int, world_size: int, steps: int, out: str) -> None:
    dims = ParallelDims.from_degrees(tp=1, pp=1)
    tcfg = TrainConfig(steps=steps, lr=1e-3, warmup_steps=1)
    inputs, targets = _batch(TINY, 8, 64)
    inputs, targets = inputs.chunk(world_size)[rank], targets.chunk(world_size)[rank]
    rows = []
    # The first configuration of a process pays page faults for every new buffer: a warm-up round
    # (not reported) keeps that out of the first reported row.
    for zero, overlap in ((0, True), (0, True), (1, True), (2, True), (2, False)):
        trainer = _zero_trainer(zero, overlap, dims, steps, os.path.join(out, f"run-dp{world_size}-rank{rank}"))
        model, opt = trainer.model, trainer.optimizer
        times = []
        for step in range(steps):
            t0 = time.perf_counter()
            opt.zero_grad()
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / (8 * 64)
            loss.backward()
            opt.reduce_grads()
            if step == steps - 1:  # what a rank holds between the reduction and the update
                grads = (opt.grad_bytes() if zero else
                         sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None))
            opt.clip_grad_norm(1.0)
            opt.step(lr_at(step + 1, tcfg))
            times.append(time.perf_counter() - t0)
        P = sum(p.numel() for p in model.parameters())
        dp = world_size
        formula = {0: (4 * P, 4 * P, 8 * P), 1: (4 * P, 4 * P, 8 * P // dp), 2: (4 * P, 4 * P // dp, 8 * P // dp)}[zero]
        rows.append({"zero": zero, "overlap": overlap, "params": P * 4, "grads": grads, "optim": opt.state_bytes(),
                     "formula": formula, "step_s": statistics.median(times[2:]), "loss": float(loss.detach())})
        trainer.logger.close()
    rows = rows[1:]
    with open(os.path.join(out, f"zero-dp{world_size}-rank{rank}.json"), "w") as f:
        json.dump(rows, f)


def bench_zero(steps: int) -> None:
    from tests.harness import run_ranks  # noqa: E402 -- the gloo spawner the tests use
    print(f"## ZeRO model states per rank: {count_params(_model(TINY)) / 1e6:.2f}M params, batch 8 x 64, "
          f"{steps} steps, fp32")
    print("| dp | zero | params MiB | grads MiB | optimizer MiB | total MiB | formula (p/g/o) MiB | step ms |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as out:
        for dp in (2, 4):
            run_ranks(dp, _zero_worker, steps, out)
            ranks = [json.load(open(os.path.join(out, f"zero-dp{dp}-rank{r}.json"))) for r in range(dp)]
            for k, row in enumerate(ranks[0]):
                assert all(r[k]["optim"] == row["optim"] for r in ranks), "dp divides every dim 0: equal shards"
                total = row["params"] + row["grads"] + row["optim"]
                formula = "/".join(f"{b / MIB:.2f}" for b in row["formula"])
                step_ms = 1e3 * statistics.median(r[k]["step_s"] for r in ranks)
                z = f"{row['zero']}" + ("" if row["overlap"] or not row["zero"] else " (no overlap)")
                print(f"| {dp} | {z} | {row['params'] / MIB:.2f} | {row['grads'] / MIB:.2f} | {row['optim'] / MIB:.2f} | "
                      f"{total / MIB:.2f} | {formula} | {step_ms:.0f} |")


# ---- recomputation ----

def _rss_bytes(field: str = "VmRSS") -> int:
    """Current (VmRSS) or peak since the last reset (VmHWM) resident bytes of this process."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM to the current RSS (Linux >= 4.0)
        f.write("5")


def _recompute_child(size: str, mode: str, precision: str, steps: int) -> dict:
    cfg, batch, seq_len = SIZES[size]
    model = _model(cfg, mode)
    inputs, targets = _batch(cfg, batch, seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")

    def step() -> float:
        t0 = time.perf_counter()
        with autocast:
            logits = model(inputs)
        F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0
    step()  # warm-up: AdamW state, thread pools and kernels exist before anything is measured
    before = _rss_bytes()
    _reset_peak_rss()
    times = [step() for _ in range(steps)]
    peak = _rss_bytes("VmHWM")
    saved = saved_activation_bytes(model, inputs, targets, autocast)
    return {"saved": saved, "peak_rss_increase": peak - before, "step_s": statistics.median(times)}


def _run_child(size: str, mode: str, precision: str, steps: int, threads: int) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(threads))
    proc = subprocess.run([sys.executable, __file__, "--child", size, mode, precision, "--steps", str(steps),
                           "--threads", str(threads)], capture_output=True, text=True, env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_recompute(steps: int, threads: int) -> None:
    print(f"## Recomputation: one process per row, {threads} thread(s), fp32, AdamW step included")
    print("| size | model | batch x T | mode | saved for backward MiB | peak RSS increase MiB | step ms | time vs none |")
    print("|---|---|---|---|---|---|---|---|")
    for size, (cfg, batch, seq_len) in SIZES.items():
        base = None
        for mode in ("none", "selective", "full"):
            r = _run_child(size, mode, "fp32", steps, threads)
            base = base or r["step_s"]
            desc = f"D={cfg.d_model} L={cfg.n_layers} F={cfg.ffn_hidden}"
            print(f"| {size} | {desc} | {batch} x {seq_len} | {mode} | {r['saved'] / MIB:.1f} | "
                  f"{r['peak_rss_increase'] / MIB:.1f} | {1e3 * r['step_s']:.0f} | {r['step_s'] / base:.2f} |")


def bench_bf16(steps: int, threads: int) -> None:
    torch.set_num_threads(threads)
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    gflops = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, y = a.to(dtype), b.to(dtype)
        x @ y
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            x @ y
            times.append(time.perf_counter() - t0)
        gflops[dtype] = 2 * n ** 3 / statistics.median(times) / 1e9
    print(f"## bf16 vs fp32 ({threads} thread(s)); matmul 1024^3: fp32 {gflops[torch.float32]:.1f} GFLOP/s, "
          f"bf16 {gflops[torch.bfloat16]:.1f} GFLOP/s; CPU flags avx512_bf16/amx: "
          f"{_cpu_has_bf16()}")
    print("| size | fp32 step ms | bf16 step ms | bf16 / fp32 | saved for backward MiB fp32 / bf16 |")
    print("|---|---|---|---|---|")
    for size in SIZES:
        fp32 = _run_child(size, "none", "fp32", steps, threads)
        bf16 = _run_child(size, "none", "bf16", steps, threads)
        print(f"| {size} | {1e3 * fp32['step_s']:.0f} | {1e3 * bf16['step_s']:.0f} | "
              f"{bf16['step_s'] / fp32['step_s']:.2f} | {fp32['saved'] / MIB:.1f} / {bf16['saved'] / MIB:.1f} |")


# ---- replica and server modes: the memory model against measured peaks ----

MODES = {  # name: (parallel keys, vocab); 2 workers (+ 2 servers for ps)
    "bsp": ({"dp": 2}, 8192),
    "ssp": ({"dp": 2, "dp_sync": "ssp", "staleness": 2}, 8192),
    "diloco": ({"dp": 2, "dp_sync": "diloco", "sync_every": 2, "outer_momentum": 0.9}, 8192),
    "ps": ({"dp": 2, "ps_servers": 2}, 65536),
    "dbs": ({"dp": 2, "microbatches": 2, "dynamic_batch": True}, 8192),
}


def _mode_recipe(mode: str, width: int, steps: int, out: str) -> Recipe:
    parallel, vocab = MODES[mode]
    model = ModelConfig(family="llama", vocab_size=vocab, d_model=64 * width, n_layers=4, n_heads=8, n_kv_heads=4,
                        ffn_hidden=176 * width, max_seq_len=128)
    return Recipe(model=model, parallel=ParallelConfig(**parallel),
                  train=TrainConfig(steps=steps, global_batch=8, seq_len=128, lr=1e-3, warmup_steps=1),
                  run=RunConfig(output_dir=out, progress=False))


def _mode_run(recipe: Recipe, dims: ParallelDims, steps: int) -> int:
    """Build and run one rank of recipe for steps steps; the peak RSS increase over the RSS before the build."""
    os.makedirs(recipe.run.output_dir, exist_ok=True)
    before = _rss_bytes()
    _reset_peak_rss()
    if dims.is_server:
        build_server(recipe, dims).serve()
        return _rss_bytes("VmHWM") - before
    tokens = np.random.default_rng(0).integers(0, recipe.model.vocab_size, 8 * 129 * 4).astype(np.int32)
    data = PackedData(tokens, np.ones(len(tokens), dtype=bool), 128, 0.0, 0)
    trainer = build_trainer(recipe, dims, loader=Loader(data, 8, dims.dp_rank, dims.dp))
    if trainer.dbs is not None:  # the busiest case the model sizes: replica 0 given its largest share
        micro = recipe.train.global_batch // dims.dp // recipe.parallel.microbatches
        trainer.dbs.counts = [trainer.dbs.total - trainer.dbs.minimum, trainer.dbs.minimum]
        trainer.loader.use_counts(trainer.dbs.counts, dims.dp_shard, micro)
    for _ in range(steps):
        trainer.train_step()
    if trainer.ps is not None:
        trainer.ps.stop(trainer.step)
    peak = _rss_bytes("VmHWM") - before
    trainer.logger.close()
    return peak


def _mode_worker(rank: int, world_size: int, mode: str, steps: int, width: int, out: str) -> None:
    torch.set_num_threads(1)
    peaks = []
    for k, w in enumerate((1, width)):  # a narrow warm-up, then the measured run
        recipe = _mode_recipe(mode, w, steps, os.path.join(out, f"{mode}-{k}"))
        peaks.append(_mode_run(recipe, ParallelDims.init(recipe.parallel), steps))
    with open(os.path.join(out, f"{mode}-rank{rank}.json"), "w") as f:
        json.dump({"peak": peaks[-1]}, f)


def bench_modes(steps: int, width: int) -> None:
    from tests.harness import run_ranks  # noqa: E402 -- the gloo spawner the tests use
    print(f"## The memory model against measured peaks: llama D={64 * width} L=4, batch 8 x 128, {steps} steps, fp32, "
          "gloo, one thread per rank")
    print("| mode | rank | predicted MiB | measured MiB | predicted / measured |")
    print("|---|---|---|---|---|")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by the spawned interpreters at start
    try:
        for mode in MODES:
            recipe = _mode_recipe(mode, width, steps, "")
            workers = 2
            world = workers + recipe.parallel.ps_servers
            with tempfile.TemporaryDirectory() as out:
                run_ranks(world, _mode_worker, mode, steps, width, out)
                peaks = [json.load(open(os.path.join(out, f"{mode}-rank{r}.json")))["peak"] for r in range(world)]
            predicted = run_memory(recipe, workers, staged_collectives=True)  # gloo on CPU
            kinds = [("worker", max(peaks[:workers]), max(r.total for r in predicted if r.role == "worker"))]
            kinds += [(f"server {r.pp_rank}", peaks[workers + r.pp_rank], r.total)
                      for r in predicted if r.role == "server"]
            for who, measured, model in kinds:
                print(f"| {mode} | {who} | {model / MIB:.1f} | {measured / MIB:.1f} | {model / measured:.2f} |")
    finally:
        del os.environ["MALLOC_MMAP_THRESHOLD_"]


def _ps_init_child(how: str) -> dict:
    """One server's rows of a V=128k, d=1024 table (2 servers), built the way `how` says."""
    m = ModelConfig(family="llama", vocab_size=131072, d_model=1024, n_layers=2, n_heads=8, max_seq_len=128)
    lo, hi = row_range(m.vocab_size, 2, 0)
    shape = (m.vocab_size, m.d_model)
    before = _rss_bytes()
    _reset_peak_rss()
    if how == "chunked":
        rows = init_rows(m, "embed.weight", shape, 1234, lo, hi)
    else:
        full = init_tensor(m, "embed.weight", shape, 1234)
        rows = full[lo:hi].clone()
        del full
    return {"peak": _rss_bytes("VmHWM") - before, "rows_bytes": rows.numel() * 4}


def bench_ps_init() -> None:
    print("## A parameter server's rows at start: V=131072 x d=1024 table (512 MiB), 2 servers, server 0")
    print("| init | rows held MiB | peak RSS increase MiB |")
    print("|---|---|---|")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    for how in ("full table, sliced", "chunked"):
        proc = subprocess.run([sys.executable, __file__, "--ps-init-child", "chunked" if how == "chunked" else "full"],
                              capture_output=True, text=True, env=env, check=True)
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"| {how} | {r['rows_bytes'] / MIB:.0f} | {r['peak'] / MIB:.0f} |")


def _cpu_has_bf16() -> str:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return "unknown"
    found = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return ", ".join(found) if found else "none"


def bench_gpu_peaks() -> None:
    from tests.unit.test_plan_memory_gpu import H200_PEAKS, recipe_of  # noqa: E402 -- the measured figures
    print("## The memory model against an H200's measured peaks (benchmarks/gpu.py rows, seq 2048 x 16, one process)")
    print("| model | train keys | measured GiB | CUDA model GiB | CUDA / measured | CPU model GiB | CPU / measured |")
    print("|---|---|---|---|---|---|---|")
    kernels = os.environ.pop("PIPETRAIN_KERNELS", None)  # the H200's rows ran the Triton kernels
    for model, train, measured in H200_PEAKS:
        recipe = recipe_of(model, train)
        cuda, cpu = (rank_memory(recipe, 1, staged_collectives=device == "cpu", device_type=device)[0].total / 2**30
                     for device in ("cuda", "cpu"))
        keys = ", ".join(f"{k}={v}" for k, v in train.items())
        print(f"| {model['family']} vocab {model['vocab_size']} | {keys} | {measured:.1f} | {cuda:.1f} | "
              f"{cuda / measured:.2f} | {cpu:.1f} | {cpu / measured:.2f} |")
    if kernels is not None:
        os.environ["PIPETRAIN_KERNELS"] = kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sections", nargs="*", default=["zero", "recompute", "bf16"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--width", type=int, default=8, help="modes: the model's width (D = 64 x width)")
    parser.add_argument("--child", nargs=3, metavar=("SIZE", "MODE", "PRECISION"), help=argparse.SUPPRESS)
    parser.add_argument("--ps-init-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(_recompute_child(*args.child, args.steps)))
        return
    if args.ps_init_child:
        print(json.dumps(_ps_init_child(args.ps_init_child)))
        return
    for section in args.sections:
        {"zero": lambda: bench_zero(args.steps), "recompute": lambda: bench_recompute(args.steps, args.threads),
         "bf16": lambda: bench_bf16(args.steps, args.threads), "modes": lambda: bench_modes(args.steps, args.width),
         "ps-init": bench_ps_init, "gpu-peaks": bench_gpu_peaks}[section]()
        print()


if __name__ == "__main__":
    main()
