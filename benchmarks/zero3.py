"""ZeRO-3 benchmark: peak memory per rank for parallel.zero 0/1/2/3, and tokens/s against zero 1 and torch FSDP2.

    python benchmarks/zero3.py [--dp 2 4] [--steps 5] [--no-fsdp] [--precision bf16|fp8|fp8-rowwise]
                               [--timeline zero3-trace.json] [--ep 2] [--dp-shard 2]

Each (dp, mode) runs in fresh gloo processes (one thread each) that train a llama whose parameters dominate
its memory (D=512, L=8, F=1408, V=8192: 34M parameters, 136 MB fp32) on 2 x 64 tokens per dp rank per step.
Per rank it reports the peak resident memory of the worker process (VmHWM from /proc/self/status, which
includes the ~0.3 GB of Python and torch every process carries), reset after a warm-up step so that it covers
the measured steps and not initialisation (which builds every parameter whole), and the median step time
after the warm-up, as tokens/s over the whole dp group. glibc's mmap threshold is pinned (64 KiB) so freed
tensors go back to the OS and RSS follows live memory. "fsdp2" is torch's fully_shard (one per block and
one at the root, reshard_after_forward=True, torch.optim.AdamW over its DTensor shards) on the same model, batch
and gloo group; where fully_shard does not run on gloo the row records why. "model state" counts, from the tensors
each pipetrain rank holds after the last step, parameters (zero 3: its rows and any gathered storage) +
gradients (zero 2/3: the reduce-scatter buffers) + AdamW moments. "gathered MiB/step" is what zero 3's
all-gathers received per step on a rank (UnitGatherer.gathered_bytes).

--precision bf16: train.precision=bf16 for pipetrain (zero 3 gathers its linear weights in bf16); FSDP2 gets
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), the same split of dtypes.

--precision fp8: train.precision=fp8 (emulated on this CPU: the float8 values are multiplied in fp32), zero 3
gathering the fp8 linears' weights in float8. FSDP2 is not run: its float8 all-gather is torchao's, whose
CPU matmuls are not pipetrain's emulation, so a time ratio would compare the two matmuls, not the sharding.
--precision fp8-rowwise: the same with train.fp8_recipe=rowwise, whose weights zero 3 gathers in fp32.

--ep EP: a mixtral-style MoE of the same attention (8 experts of F=704, top 2: 84M parameters, 69M in experts)
at parallel.ep=EP, where zero 1/2/3 shard the experts over expert-dp (dp / EP ranks) and the rest over dp
(pipetrain.parallel.expert.zero); "gathered MiB/step" sums both parts' gathers.

--dp-shard N: HSDP, parallel.dp_shard=N (dp / N replicas): ZeRO shards inside each replica of N ranks (under ep
the experts over the replica's N / EP holders of them) and the replicas sum their rows every step.

--timeline PATH: zero 3 keeps the gather hooks' event log (UnitGatherer.events) during its last step; rank 0
writes it as a Chrome trace (chrome://tracing, ui.perfetto.dev: one row of unit compute, one of all-gathers,
from issue to the first moment the hooks saw it complete) and prints, per pass, how many prefetched gathers
had completed before the compute they were issued behind ended, and the time spent waiting for gathers.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from common import proc_status_bytes  # benchmarks/common.py; puts the repository root on sys.path
from pipetrain.config import ModelConfig  # noqa: E402
from pipetrain.models import build, count_params, materialize  # noqa: E402
from pipetrain.parallel.mesh.dims import ParallelDims  # noqa: E402
from tests.unit.common import build_trainer  # noqa: E402

MODEL = ModelConfig(family="llama", vocab_size=8192, d_model=512, n_layers=8, n_heads=8, n_kv_heads=4,
                    ffn_hidden=1408, max_seq_len=64)
# --ep: the same attention with 8 experts of ffn 704, top 2 (84M parameters, 69M of them experts)
MOE_MODEL = ModelConfig(family="mixtral", vocab_size=8192, d_model=512, n_layers=8, n_heads=8, n_kv_heads=4,
                        max_seq_len=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=704)
SEQ, PER_RANK = 64, 2  # tokens per sequence, sequences per dp rank per step
GIB = 2 ** 30


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM to the current RSS (Linux >= 4.0)
        f.write("5")


def _pipetrain(dims, zero: int, steps: int, out: str, precision: str, timeline: bool = False) -> tuple:
    model = MOE_MODEL if dims.ep > 1 else MODEL
    trainer = build_trainer(model, out, dims, zero=zero, steps=steps + 1, global_batch=PER_RANK * dims.dp,
                            seq_len=SEQ, grad_clip=1.0, precision=precision.split("-")[0],
                            fp8_recipe="rowwise" if precision == "fp8-rowwise" else "tensorwise", ep=dims.ep,
                            dp_shard=dims.dp_shard if dims.dp_shard < dims.dp else None)
    # zero 3's gatherers: one, or under ep one per part (the experts' over expert-dp, the rest over dp)
    gatherers = [g for g in (getattr(o, "gatherer", None) for o in getattr(trainer.optimizer, "parts",
                                                                           (trainer.optimizer,))) if g is not None]
    times, events, gathered = [], [], 0
    for step in range(steps + 1):
        if timeline and step == steps:
            gatherers[0].events = events
        start = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - start)
        if len(times) == 1:
            _reset_hwm()
            gathered = -sum(sum(g.gathered_bytes.values()) for g in gatherers)
    gathered += sum(sum(g.gathered_bytes.values()) for g in gatherers)
    names = [u.name for u in gatherers[0].units] if timeline else []
    return times[1:], _model_state_bytes(trainer), (events, names), gathered / steps


def _spans(events: list) -> tuple[list, list]:
    """(compute spans (unit, pass, start, end), gathers (unit, pass, issued, complete, waited, done_before_wait))
    from a UnitGatherer event log: a unit's forward runs from its pre-hook to its post-hook, its backward
    until the next hook event; a gather is complete at the first sign of it (a hook saw it done, or its wait
    returned), and waited is how long the main thread blocked on it."""
    compute, gathers, flight, wait_start = [], [], {}, {}
    for n, (t, event, k) in enumerate(events):
        if event == "forward":
            end = next(e[0] for e in events[n:] if e[1] == "forward_end" and e[2] == k)
            compute.append((k, "forward", t, end))
        elif event == "backward":
            end = next((e[0] for e in events[n + 1:] if e[1] in ("forward", "backward")), events[-1][0])
            compute.append((k, "backward", t, end))
        elif event.startswith("gather "):  # "gather forward" / "gather backward": the pass it serves
            flight[k] = [event.split()[1], t, None, False]
        elif event == "done" and k in flight and flight[k][2] is None:
            flight[k][2:] = [t, k not in wait_start]
        elif event == "wait":
            wait_start[k] = t
        elif event == "gathered" and k in flight:
            phase, issued, complete, hidden = flight.pop(k)
            gathers.append((k, phase, issued, complete or t, t - wait_start.pop(k), hidden))
    return compute, gathers


def _write_timeline(events: list, path: str, names: list[str]) -> None:
    """A Chrome trace of rank 0's last step, and a summary of the overlap per pass."""
    compute, gathers = _spans(events)
    t0 = events[0][0]
    trace = [{"name": f"{p} {names[k]}", "ph": "X", "pid": 0, "tid": "compute", "ts": (a - t0) * 1e6,
              "dur": (b - a) * 1e6} for k, p, a, b in compute]
    trace += [{"name": f"all-gather {names[k]}", "ph": "X", "pid": 0, "tid": "all-gather", "ts": (a - t0) * 1e6,
               "dur": (b - a) * 1e6} for k, _, a, b, _, _ in gathers]
    with open(path, "w") as f:
        json.dump({"traceEvents": trace}, f)
    for phase in ("forward", "backward"):
        mine = [g for g in gathers if g[1] == phase]
        work = sum(b - a for _, p, a, b in compute if p == phase)
        flight = sum(g[3] - g[2] for g in mine)
        waited = sum(g[4] for g in mine)
        print(f"timeline {phase}: {work * 1e3:.0f} ms of unit compute; {len(mine)} all-gathers, "
              f"{sum(g[5] for g in mine)} complete before their wait; {flight * 1e3:.0f} ms in flight, "
              f"{waited * 1e3:.0f} ms of it waited for (exposed), {(flight - waited) * 1e3:.0f} ms behind compute")
    print(f"timeline: trace of rank 0's last step written to {path}")


def _model_state_bytes(trainer) -> int:
    """Parameter + gradient + AdamW bytes this rank holds after the last step, counted from the tensors."""
    opt, params = trainer.optimizer, list(trainer.model.parameters())
    held = opt.param_bytes() if hasattr(opt, "param_bytes") else sum(p.numel() * p.element_size() for p in params)
    grads = opt.grad_bytes() if hasattr(opt, "grad_bytes") else sum(
        p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    return held + grads + opt.state_bytes()


def _fsdp2(dp: int, steps: int, precision: str) -> list[float]:
    # torch's FSDP2 is the baseline being measured, imported only here
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh("cpu", (dp,))
    model = materialize(build(MODEL, device="meta"), MODEL, 0, "cpu")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if precision == "bf16" else None,
                                  reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    times = []
    for _ in range(steps + 1):
        tokens = torch.randint(0, MODEL.vocab_size, (PER_RANK, SEQ + 1), generator=gen)
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        if len(times) == 1:
            _reset_hwm()
    return times[1:]


def _worker(rank, dp, mode, steps, init_file, out, results, precision, timeline=None, ep=1, dp_shard=None):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=dp,
                            timeout=timedelta(seconds=600))
    try:
        if mode == "fsdp2" and precision.startswith("fp8"):
            results[rank] = {"error": "fp8 is compared on a GPU (torchao's float8 all-gather there; pipetrain's "
                                      "fp8 is emulated on the CPU)"}
            return
        if mode == "fsdp2":
            try:
                times, state, gathered = _fsdp2(dp, steps, precision), None, None
            except Exception as exc:  # record why fully_shard does not run here
                results[rank] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
                return
        else:
            run_dir = os.path.join(out, f"rank{rank}")
            os.makedirs(run_dir, exist_ok=True)
            dims = ParallelDims.from_degrees(ep=ep, dp_shard=dp_shard or dp)
            times, state, (events, names), gathered = _pipetrain(dims, int(mode[-1]), steps, run_dir, precision,
                                                                 timeline is not None and mode == "zero3")
            if events and rank == 0:
                _write_timeline(events, timeline, names)
        results[rank] = {"step_s": statistics.median(times), "vm_hwm": proc_status_bytes("VmHWM"), "state": state,
                         "gathered": gathered}
    finally:
        dist.destroy_process_group()


def run(dp: int, mode: str, steps: int, precision: str = "fp32", timeline: str | None = None, ep: int = 1,
        dp_shard: int | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(dp, mode, steps, os.path.join(tmp, "rdzv"), tmp, results, precision, timeline, ep,
                                dp_shard), nprocs=dp)
        return dict(results)


def main() -> None:
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by the spawned workers' glibc at start
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[2])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-fsdp", action="store_true")
    parser.add_argument("--modes", nargs="+", default=None, help="a subset of zero0 zero1 zero2 zero3 fsdp2")
    parser.add_argument("--timeline", default=None, help="write zero 3's last step (rank 0) as a Chrome trace here")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp8", "fp8-rowwise"], default="fp32")
    parser.add_argument("--ep", type=int, default=1, help="a mixtral-style MoE (8 experts) at parallel.ep=EP: zero "
                        "1/2/3 shard its experts over expert-dp (dp / EP ranks); FSDP2 is not run")
    parser.add_argument("--dp-shard", type=int, default=None, help="HSDP: parallel.dp_shard (default: dp, one "
                        "replica); FSDP2 is not run")
    args = parser.parse_args()
    model = MOE_MODEL if args.ep > 1 else MODEL
    params = count_params(build(model, device="meta"))
    width = f"{model.num_experts} experts of F={model.expert_ffn}, ep {args.ep}" if args.ep > 1 else f"F={model.ffn}"
    print(f"model: {model.family} D={model.d_model} L={model.n_layers} {width} V={model.vocab_size}, "
          f"{params / 1e6:.1f}M parameters ({4 * params / GIB:.3f} GiB fp32); {PER_RANK} x {SEQ} tokens per dp rank "
          f"per step; median of {args.steps} steps after a warm-up; one thread per rank, gloo; {args.precision}"
          + (f"; dp_shard {args.dp_shard}" if args.dp_shard else ""))
    print(f"{'dp':>3} {'mode':<7} {'peak RSS/rank GiB (max)':>24} {'model state/rank GiB':>21} {'tokens/s':>9} "
          f"{'gathered MiB/step':>18}")
    plain = not (args.no_fsdp or args.ep > 1 or args.dp_shard)
    modes = args.modes or ["zero0", "zero1", "zero2", "zero3"] + (["fsdp2"] if plain else [])
    for dp in args.dp:
        for mode in modes:
            res = run(dp, mode, args.steps, args.precision, args.timeline, args.ep, args.dp_shard)
            if any("error" in r for r in res.values()):
                print(f"{dp:>3} {mode:<7} does not run: {next(r['error'] for r in res.values() if 'error' in r)}")
                continue
            hwm = max(r["vm_hwm"] for r in res.values()) / GIB
            step = max(r["step_s"] for r in res.values())
            state = max(r["state"] for r in res.values()) / GIB if mode != "fsdp2" else float("nan")
            gathered = max(r["gathered"] or 0 for r in res.values()) / 2 ** 20
            print(f"{dp:>3} {mode:<7} {hwm:>24.3f} {state:>21.3f} {PER_RANK * SEQ * dp / step:>9.0f} "
                  f"{gathered:>18.1f}", flush=True)


if __name__ == "__main__":
    main()
