"""Context parallelism on CPU with gloo: per-rank activation memory and tokens/s at cp 1, 2, 4.

For each cp it spawns cp gloo processes (one thread each) and runs, on one long sequence of a tiny llama
(D 64, 2 layers, 4 query heads / 1 kv head, V 256), forward + cross-entropy + backward on this rank's
head/tail slice, with pipetrain.parallel.context's all-gather attention (K/V gathered over cp, dK/dV
reduce-scattered). Measured per rank 0:
- activation bytes: the distinct storages the forward keeps for backward (saved_tensors_hooks, parameters
  left out), i.e. what grows with the sequence;
- peak resident memory growth during the timed steps (VmHWM after - VmRSS before), a coarse allocator view;
- tokens/s: the whole sequence's tokens / median step time over --steps steps after a warm-up step, each
  step starting at a barrier;
- beside them the planner's predictions (plan.memory's activation bytes, plan.cost's tokens/s on the "cpu"
  profile): what parallel.auto and --dry-run would say of this layout.
Then it tries torch.distributed.tensor.experimental.context_parallel (ring attention by patching SDPA) on
the same shapes and prints its error if it cannot run here (on CPU it does not: the CPU flash-attention op has
no sharding strategy; it needs CUDA, and cp needs several GPUs).

Usage: python benchmarks/context_parallel.py [--seq 4096] [--cp 1 2 4] [--steps 5]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import run_ranks
from torch.distributed.device_mesh import init_device_mesh

from pipetrain.config import ModelConfig, ParallelConfig, Recipe, TrainConfig
from pipetrain.kernels import cross_entropy
from pipetrain.models import build, materialize
from pipetrain.parallel.context.attention import apply_context_parallel
from pipetrain.parallel.context.slicing import chunk_index
from pipetrain.parallel.mesh import comm
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.plan.cost import step_time
from pipetrain.plan.devices import DEVICES
from pipetrain.plan.memory import activation_bytes
from tests.harness import saved_activation_bytes


def config(seq: int) -> ModelConfig:
    return ModelConfig(family="llama", vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=1,
                       ffn_hidden=128, max_seq_len=seq)


def predicted(seq: int, cp: int) -> tuple[int, float]:
    """The planner's (activation bytes per rank, tokens/s) for this run: plan.memory and plan.cost on the
    uncalibrated "cpu" profile with this machine's cores (ranks beyond them share them), the figures
    parallel.auto ranks layouts by."""
    recipe = Recipe(model=config(seq), parallel=ParallelConfig(cp=cp), train=TrainConfig(global_batch=1, seq_len=seq))
    profile = dataclasses.replace(DEVICES["cpu"], cores=os.cpu_count() or 1)
    return activation_bytes(recipe, cp, 0, in_flight=1), step_time(recipe, cp, profile).tokens_per_s


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _batch(cfg: ModelConfig, seq: int):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _pipetrain(rank: int, world_size: int, seq: int, steps: int) -> dict:
    cfg = config(seq)
    dims = ParallelDims.from_degrees(cp=world_size)
    model = build(cfg, device="meta")
    apply_context_parallel(model, dims, seq, document_mask=False)
    materialize(model, cfg, 0, "cpu")
    inputs, targets = _batch(cfg, seq)
    index = chunk_index(seq, dims.cp, dims.cp_rank)
    inputs, targets = inputs[:, index], targets[:, index]
    positions = index[None] if dims.cp > 1 else None  # cp 1: the plain causal path (no mask), as training runs it
    count = targets.numel() * dims.cp  # the global target count: each rank's loss is its share of the mean
    activation = saved_activation_bytes(model, inputs, targets, positions=positions)
    times = []
    rss0 = _status_kib("VmRSS")
    for step in range(steps + 1):
        comm.barrier(world_size)
        t0 = time.perf_counter()
        logits = model(inputs) if positions is None else model(inputs, positions)
        loss = cross_entropy(logits, targets) * targets.numel() / count
        loss.backward()
        if world_size > 1:  # the gradient sum over cp, as the optimizer's dp x cp reduction does
            for p in model.parameters():
                comm.all_reduce_(p.grad, dims.cp_group)
        model.zero_grad(set_to_none=True)
        if step:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    return {"activation_bytes": activation, "rss_growth_kib": _status_kib("VmHWM") - rss0, "step_s": step_s,
            "tokens_per_s": seq / step_s}


def _torch_cp(rank: int, world_size: int, seq: int) -> str:
    """torch's own context parallelism on plain causal attention: 'ok' or the error it raises here."""
    from torch.distributed.tensor.experimental import context_parallel  # experimental API: only this probe uses it
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    x = torch.randn(1, seq, 64)
    w = torch.randn(64, 3 * 64, requires_grad=True)
    try:
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
            q, k, v = (x @ w).view(1, x.shape[1], 3, 4, 16).permute(2, 0, 3, 1, 4)
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        return "ok"
    except (RuntimeError, NotImplementedError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    finally:
        dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    base = None
    print(f"llama D 64, 2 layers, 4/1 heads, one sequence of {args.seq} tokens; gloo on CPU, one thread per rank")
    print("| cp | activation MiB / rank | vs cp 1 | planner MiB | RSS growth MiB / rank | step s | tokens/s | "
          "planner tokens/s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for cp in args.cp:
        r = run_ranks(cp, _pipetrain, args.seq, args.steps)
        base = base or r["activation_bytes"]
        planned_bytes, planned_speed = predicted(args.seq, cp)
        print(f"| {cp} | {r['activation_bytes'] / 2**20:.1f} | {r['activation_bytes'] / base:.2f}x | "
              f"{planned_bytes / 2**20:.1f} | {r['rss_growth_kib'] / 1024:.1f} | {r['step_s']:.3f} | "
              f"{r['tokens_per_s']:,.0f} | {planned_speed:,.0f} |", flush=True)
    print("torch context_parallel (cp 2):", run_ranks(2, _torch_cp, args.seq))


if __name__ == "__main__":
    main()
