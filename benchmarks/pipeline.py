"""Pipeline parallelism on CPU with gloo: pipetrain's executor against torch.distributed.pipelining.

For pp in 2, 4 it spawns pp gloo processes (one thread each) and runs one small llama (D 256, 8 layers,
8 heads / 4 kv heads, F 704, V 8192) on a fixed batch of 8 microbatches x 2 sequences x T 128 under
gpipe, 1f1b and interleaved-1f1b (v 2), with both frameworks on the very same stage modules:
pipetrain's Decoder pruned by build_stage, run by pipetrain's Executor, and the same chunk modules
wrapped in torch.distributed.pipelining.PipelineStage and run by ScheduleGPipe / Schedule1F1B /
ScheduleInterleaved1F1B. Both use pipetrain's loss (sum of CE / target tokens of the global batch,
so torch runs with scale_grads=False) and return_outputs=False, so the mathematics is identical.

Measured (a step = forward + backward of the global batch; no optimizer step, which the frameworks
share):
- tokens/s: 2048 tokens / step time, median over --rounds rounds after a warm-up round. A step
  starts at a barrier; its time is the slowest rank's. Each round runs all 6 (schedule, framework)
  cases, rotating the order, so the shared machine's noise hits them alike; ratio = pipetrain / torch.
- idle fraction per rank: (time in Work.wait() during the step + time between the rank's own end and
  the slowest rank's end) / step time, against the formula (p-1)/(v*m+p-1). pipetrain's waits are
  timed by TimedExecutor (the executor's torch.distributed calls go through a proxy whose Works time
  wait()); torch's by wrapping torch.distributed.pipelining.schedules._wait_batch_p2p.
- parity: in the warm-up round, the loss of both frameworks and the largest gradient difference.
- memory, in a fresh set of processes per (pp, schedule, framework) running 2 steps: peak RSS per rank
  (getrusage ru_maxrss; includes the interpreter, torch and the parameters) and its rise over the RSS
  before the first step, plus the peak bytes held for backward (saved_tensors_hooks: distinct
  storages saved by autograd, parameters excluded).

Usage: python benchmarks/pipeline.py [--rounds 7] [--pp 2 4] [--no-memory] [--json out.json]
Shapes: B batch, T time, D model, V vocab; m microbatches, p pp ranks, v chunks per rank.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import pipetrain.parallel.executor as executor_mod  # noqa: E402
from pipetrain.config import ModelConfig, ParallelConfig  # noqa: E402
from pipetrain.data import Batch  # noqa: E402
from pipetrain.models import build, materialize  # noqa: E402
from pipetrain.parallel.dims import ParallelDims  # noqa: E402
from pipetrain.parallel.executor import Executor  # noqa: E402
from pipetrain.parallel.pipeline import build_stage  # noqa: E402
from pipetrain.parallel.schedule_sim import ideal_bubble  # noqa: E402
from pipetrain.parallel.schedules import build_schedule  # noqa: E402
from pipetrain.trainer import loss_sum  # noqa: E402

CFG = ModelConfig(family="llama", vocab_size=8192, d_model=256, n_layers=8, n_heads=8, n_kv_heads=4,
                  ffn_hidden=704, max_seq_len=128)
SEQ, MICRO, NUM_MB, SEED = 128, 2, 8, 0
CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)]
FRAMEWORKS = ("pipetrain", "torch")


# ---- where a step's time goes ------------------------------------------------------------------------
KINDS = ("forward", "loss", "backward", "wait")


class StepClock:
    """Seconds per kind (KINDS) since the last reset; the rest of a step is framework overhead."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.totals = dict.fromkeys(KINDS, 0.0)

    def timed(self, kind: str, fn, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.totals[kind] += time.perf_counter() - t0

    def timed_wait(self, work) -> None:
        self.timed("wait", work.wait)


class _TimedWork:
    def __init__(self, work, clock: StepClock):
        self._work, self._clock = work, clock

    def wait(self):
        self._clock.timed_wait(self._work)
        return True


class _TimedDist:
    """torch.distributed as the executor sees it, except that batch_isend_irecv's Works time wait()."""

    def __init__(self, clock: StepClock):
        self._clock = clock

    def __getattr__(self, name):
        return getattr(dist, name)

    def batch_isend_irecv(self, ops):
        return [_TimedWork(w, self._clock) for w in dist.batch_isend_irecv(ops)]


class TimedExecutor(Executor):
    """pipetrain's Executor with its waits timed; the executor module itself is left untouched."""

    def __init__(self, *args, clock: StepClock, **kwargs):
        super().__init__(*args, **kwargs)
        self.clock = clock

    def run(self, *args, **kwargs):
        saved = executor_mod.dist
        executor_mod.dist = _TimedDist(self.clock)
        try:
            return super().run(*args, **kwargs)
        finally:
            executor_mod.dist = saved


def _instrument(clock: StepClock) -> None:
    """Time every backward (both frameworks call torch.autograd.backward; Tensor.backward does too)
    and torch.distributed.pipelining's waits (all go through schedules._wait_batch_p2p). Benchmark
    processes only."""
    import torch.distributed.pipelining.schedules as tsched

    backward = torch.autograd.backward
    torch.autograd.backward = lambda *a, **k: clock.timed("backward", backward, *a, **k)

    def wait_batch(works):
        for w in works:
            clock.timed_wait(w)

    tsched._wait_batch_p2p = wait_batch


def _time_forward(model: torch.nn.Module, chunks, clock: StepClock) -> None:
    """Time every chunk call. The chunk views of build_stage are shallow copies of model, so they share
    its hook dicts: one registration covers them all."""
    started = []
    model.register_forward_pre_hook(lambda *_: started.append(time.perf_counter()))

    def done(*_):
        clock.totals["forward"] += time.perf_counter() - started.pop()

    model.register_forward_hook(done)
    assert all(c._forward_hooks is model._forward_hooks for c in chunks), "chunk views no longer share hooks"


# ---- memory held for backward ------------------------------------------------------------------------
class SavedBytes:
    """Peak bytes of distinct non-parameter storages that autograd holds for backward."""

    def __init__(self, params):
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.live: dict[int, list[int]] = {}  # storage ptr -> [references, bytes]
        self.current = self.peak = 0

    def pack(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.param_ptrs or t.device.type == "meta":
            return t
        entry = self.live.setdefault(ptr, [0, t.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        return _Held(t, self, ptr)

    @staticmethod
    def unpack(x):
        return x.tensor if isinstance(x, _Held) else x

    def release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[ptr]

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Held:
    def __init__(self, tensor, counter: SavedBytes, ptr: int):
        self.tensor, self._counter, self._ptr = tensor, counter, ptr

    def __del__(self):
        self._counter.release(self._ptr)


# ---- one configuration on one rank -------------------------------------------------------------------
def _batch() -> Batch:
    gen = torch.Generator().manual_seed(1)
    shape = (MICRO * NUM_MB, SEQ)
    return Batch(torch.randint(0, CFG.vocab_size, shape, generator=gen),
                 torch.randint(0, CFG.vocab_size, shape, generator=gen))


def _build_case(dims: ParallelDims, schedule: str, v: int, clock: StepClock):
    """(model, {framework: step function returning this rank's share of the loss}) for one schedule."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    pcfg = ParallelConfig(pp=dims.pp, microbatches=NUM_MB, schedule=schedule, virtual_stages=v)
    model, chunks, specs = build_stage(build(CFG), dims, pcfg, SEQ)
    materialize(model, CFG, SEED, "cpu")
    batch = _batch()
    num_targets = batch.targets.numel()  # random tokens: nothing is ignored
    microbatches = batch.split(NUM_MB)

    _time_forward(model, chunks, clock)

    def loss_fn(logits, targets):  # pipetrain's executor divides by num_targets itself
        return clock.timed("loss", loss_sum, logits, targets)

    executor = TimedExecutor(chunks, specs, dims, (MICRO, SEQ, CFG.d_model), torch.float32,
                             loss_fn=loss_fn, clock=clock)
    actions = build_schedule(schedule, dims.pp_rank, dims.pp, NUM_MB, v)

    def pipetrain_step() -> float:
        return float(executor.run(actions, microbatches, num_targets)) / num_targets

    stages = [PipelineStage(chunk, spec.stage, dims.pp * v, torch.device("cpu"), group=dims.pp_group)
              for chunk, spec in zip(chunks, specs)]

    def torch_loss_fn(logits, targets):
        return loss_fn(logits, targets) / num_targets

    if schedule == "gpipe":
        sched = ScheduleGPipe(stages[0], NUM_MB, loss_fn=torch_loss_fn, scale_grads=False)
    elif schedule == "1f1b":
        sched = Schedule1F1B(stages[0], NUM_MB, loss_fn=torch_loss_fn, scale_grads=False)
    else:
        sched = ScheduleInterleaved1F1B(stages, NUM_MB, loss_fn=torch_loss_fn, scale_grads=False)
    has_first, has_last = any(s.is_first for s in specs), any(s.is_last for s in specs)

    def torch_step() -> float:
        losses: list[torch.Tensor] = []
        args = (batch.inputs,) if has_first else ()
        sched.step(*args, target=batch.targets if has_last else None, losses=losses, return_outputs=False)
        return sum(float(x.detach()) for x in losses)

    return model, {"pipetrain": pipetrain_step, "torch": torch_step}


def _timed_step(dims: ParallelDims, model, step, clock: StepClock) -> dict:
    """One barrier-started step. Every rank gets the per-rank seconds and KINDS breakdown, and the loss."""
    model.zero_grad(set_to_none=True)
    dist.barrier(group=dims.pp_group)
    clock.reset()
    t0, c0 = time.perf_counter(), time.process_time()
    loss = step()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    mine = torch.tensor([seconds, loss, cpu] + [clock.totals[k] for k in KINDS], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dims.pp)]
    dist.all_gather(every, mine, group=dims.pp_group)
    out = {"seconds": [float(t[0]) for t in every], "step_loss": sum(float(t[1]) for t in every),
           "cpu": [float(t[2]) for t in every]}
    out.update({k: [float(t[3 + i]) for t in every] for i, k in enumerate(KINDS)})
    return out


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _timing_worker(dims: ParallelDims, rounds: int, out_path: str) -> None:
    clock = StepClock()
    _instrument(clock)
    cases = {(s, v): _build_case(dims, s, v, clock) for s, v in CASES}
    results = {f"{s}|{fw}": [] for s, _ in CASES for fw in FRAMEWORKS}
    parity = {}
    for r in range(rounds + 1):
        order = CASES[r % len(CASES):] + CASES[:r % len(CASES)]
        for s, v in order:
            model, steps = cases[(s, v)]
            fws = FRAMEWORKS if r % 2 == 0 else FRAMEWORKS[::-1]
            if r == 0:  # warm-up: torch infers shapes here; check the two agree on loss and gradients
                rec = {fw: _timed_step(dims, model, steps[fw], clock) for fw in FRAMEWORKS[:1]}
                grads = _grads(model)
                rec["torch"] = _timed_step(dims, model, steps["torch"], clock)
                diff = max((float((p.grad - grads[n]).abs().max()) for n, p in model.named_parameters()
                            if p.grad is not None), default=0.0)
                scale = max((float(g.abs().max()) for g in grads.values()), default=0.0)
                both = torch.tensor([diff, scale], dtype=torch.float64)
                dist.all_reduce(both, op=dist.ReduceOp.MAX, group=dims.pp_group)
                parity[s] = {"loss_pipetrain": rec["pipetrain"]["step_loss"], "loss_torch": rec["torch"]["step_loss"],
                             "max_grad_diff": float(both[0]), "max_grad": float(both[1])}
                continue
            for fw in fws:
                results[f"{s}|{fw}"].append(_timed_step(dims, model, steps[fw], clock))
    if dims.rank == 0:
        with open(out_path, "w") as f:
            json.dump({"steps": results, "parity": parity}, f)


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _memory_worker(dims: ParallelDims, schedule: str, v: int, framework: str, out_path: str) -> None:
    """Peak RSS over the process's life up to the end of step 1 (which also allocates the gradients and,
    for torch, infers shapes), then of step 2 alone: writing 5 to /proc/self/clear_refs resets the
    high-water mark that getrusage reports. Saved-for-backward peak of step 2."""
    clock = StepClock()
    model, steps = _build_case(dims, schedule, v, clock)
    gc.collect()
    before = _rss_bytes()
    counter = SavedBytes(model.parameters())
    figures = []
    for i in range(2):
        model.zero_grad(set_to_none=True)
        if i == 1:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            counter.peak = counter.current
        with counter.hooks():
            steps[framework]()
        figures.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux reports KiB
    mine = torch.tensor([before, *figures, counter.peak], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dims.pp)]
    dist.all_gather(every, mine, group=dims.pp_group)
    if dims.rank == 0:
        with open(out_path, "w") as f:
            json.dump({key: [float(t[i]) for t in every]
                       for i, key in enumerate(("rss_before", "peak_rss_first", "peak_rss_step", "saved"))}, f)


def _worker(rank: int, world_size: int, init_file: str, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=600))
    try:
        fn(ParallelDims.from_degrees(pp=world_size), *args)
    finally:
        dist.destroy_process_group()


def _spawn(world_size: int, fn, *args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_worker, args=(world_size, os.path.join(tmp, "rdzv"), fn, (*args, out)), nprocs=world_size)
        with open(out) as f:
            return json.load(f)


# ---- report -------------------------------------------------------------------------------------------
def _summary(pp: int, timing: dict) -> dict:
    """Medians over rounds: tokens/s, per-rank idle and time breakdown, and the paired ratio."""
    tokens = MICRO * NUM_MB * SEQ
    out = {}
    for s, v in CASES:
        for fw in FRAMEWORKS:
            recs = timing["steps"][f"{s}|{fw}"]
            span = [max(r["seconds"]) for r in recs]
            # Idle: waits inside the step, plus the tail after this rank finished and the slowest had not.
            idle = [[(r["wait"][k] + max(r["seconds"]) - r["seconds"][k]) / max(r["seconds"]) for r in recs]
                    for k in range(pp)]
            parts = {kind: [statistics.median(r[kind][k] for r in recs) for k in range(pp)] for kind in KINDS}
            parts["other"] = [statistics.median(r["seconds"][k] - sum(r[kind][k] for kind in KINDS) for r in recs)
                              for k in range(pp)]
            parts["cpu"] = [statistics.median(r["cpu"][k] for r in recs) for k in range(pp)]
            out[(s, fw)] = {"tokens_per_s": tokens / statistics.median(span), "step_s": statistics.median(span),
                            "idle": [statistics.median(x) for x in idle], "parts": parts,
                            "formula": ideal_bubble(pp, NUM_MB, v)}
        # pipetrain tokens/s over torch tokens/s = torch step time / pipetrain step time, paired per round
        pairs = zip(timing["steps"][f"{s}|pipetrain"], timing["steps"][f"{s}|torch"])
        out[(s, "ratio")] = statistics.median(max(t["seconds"]) / max(p["seconds"]) for p, t in pairs)
    return out


def _name(schedule: str, v: int) -> str:
    return schedule + (f" v{v}" if v > 1 else "")


def _print_timing(pp: int, rounds: int, summary: dict, parity: dict) -> None:
    print(f"\npp {pp}: median of {rounds} rounds; ratio = pipetrain tok/s / torch tok/s (paired per round)")
    print("| schedule | pipetrain tok/s | torch tok/s | ratio | idle pipetrain (per rank) | "
          "idle torch (per rank) | formula | loss pipetrain / torch | max grad diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s, v in CASES:
        p_, t_, par = summary[(s, "pipetrain")], summary[(s, "torch")], parity[s]
        print(f"| {_name(s, v)} | {p_['tokens_per_s']:.0f} | {t_['tokens_per_s']:.0f} | {summary[(s, 'ratio')]:.2f} | "
              f"{' '.join(f'{x:.2f}' for x in p_['idle'])} | {' '.join(f'{x:.2f}' for x in t_['idle'])} | "
              f"{p_['formula']:.2f} | {par['loss_pipetrain']:.6f} / {par['loss_torch']:.6f} | "
              f"{par['max_grad_diff']:.1e} (of {par['max_grad']:.1e}) |")
    print(f"\npp {pp}: ms per step on each rank (rank 0 / rank 1 / ...), wall clock; other = the step minus "
          "the rest (framework bookkeeping, posting p2p ops, allocation); cpu = the process's CPU time")
    columns = KINDS + ("other", "cpu")
    print("| schedule | framework | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for s, v in CASES:
        for fw in FRAMEWORKS:
            parts = summary[(s, fw)]["parts"]
            cells = [" / ".join(f"{x * 1e3:.0f}" for x in parts[kind]) for kind in columns]
            print(f"| {_name(s, v)} | {fw} | " + " | ".join(cells) + " |")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="measured rounds after one warm-up round")
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--no-memory", action="store_true", help="skip the fresh-process memory runs")
    parser.add_argument("--json", default=None, help="also write every raw figure to this file")
    args = parser.parse_args()
    print(f"model: llama D {CFG.d_model}, {CFG.n_layers} layers, V {CFG.vocab_size}; m {NUM_MB} microbatches of "
          f"{MICRO} x T {SEQ} = {MICRO * NUM_MB * SEQ} tokens/step; 1 thread per rank, gloo, "
          f"{os.cpu_count()} CPUs", flush=True)
    raw = {}
    for pp in args.pp:
        t0 = time.perf_counter()
        timing = _spawn(pp, _timing_worker, args.rounds)
        summary = _summary(pp, timing)
        raw[f"pp{pp}"] = {"timing": timing}
        _dump(args.json, raw)
        print(f"\npp {pp} timing took {time.perf_counter() - t0:.0f} s", end="")
        _print_timing(pp, args.rounds, summary, timing["parity"])
        if args.no_memory:
            continue
        mib = 2 ** 20
        print(f"\npp {pp} memory, MiB per rank (rank 0 / rank 1 / ...), fresh processes per row: RSS before the "
              "first step; peak RSS up to the end of step 1; peak RSS of step 2 alone; peak saved for backward "
              "in step 2")
        print("| schedule | framework | RSS before | peak RSS (setup + step 1) | peak RSS (step 2) | saved for backward |")
        print("|---|---|---|---|---|---|")
        for s, v in CASES:
            mem = {fw: _spawn(pp, _memory_worker, s, v, fw) for fw in FRAMEWORKS}
            raw[f"pp{pp}"][f"memory|{s}"] = mem
            _dump(args.json, raw)
            for fw in FRAMEWORKS:
                cells = [" / ".join(f"{x / mib:.0f}" for x in mem[fw][key])
                         for key in ("rss_before", "peak_rss_first", "peak_rss_step", "saved")]
                print(f"| {_name(s, v)} | {fw} | " + " | ".join(cells) + " |", flush=True)
    _dump(args.json, raw)


def _dump(path: str | None, raw: dict) -> None:
    if path:  # after every measurement, so an interrupted run keeps what it measured
        with open(path, "w") as f:
            json.dump(raw, f, indent=1)


if __name__ == "__main__":
    main()
