"""Pipeline parallelism on CPU with gloo: pipetrain's executor against torch.distributed.pipelining.

For pp in 2, 4 it spawns pp gloo processes (one thread each) and runs one small llama (D 256, 8 layers,
8 heads / 4 kv heads, F 704, V 8192) on a fixed batch of 8 microbatches x 2 sequences x T 128 under
gpipe, 1f1b, interleaved-1f1b (v 2) and the V schedules zbv and dualpipev (two chunks per rank,
rank r holding stages r and 2p-1-r), with both frameworks on the very same stage modules:
pipetrain's Decoder pruned by build_stage, run by pipetrain's Executor, and the same chunk modules
wrapped in torch.distributed.pipelining.PipelineStage and run by ScheduleGPipe / Schedule1F1B /
ScheduleInterleaved1F1B / ScheduleZBVZeroBubble / ScheduleDualPipeV. The V schedules always split
their backward (W actions), so for them "pipetrain" and "pipetrain-split" run the same actions. Both use pipetrain's loss (sum of CE / target tokens of the global batch,
so torch runs with scale_grads=False) and return_outputs=False, so the mathematics is identical.

pipetrain runs three ways: as it trains by default (exactly torch's actions: B does the whole
backward; weight gradients added into .grad in place, train.grad_accumulation_fusion), with
parallel.split_backward on as well (each B computes the input gradient and sends it, W actions
compute the weight gradients where the rank would otherwise wait; the same F and B order), and
"unfused": the default with the fusion off, i.e. torch's actions and plain autograd, which isolates
what the executor itself costs.

Measured (a step = forward + backward of the global batch; no optimizer step, which the frameworks
share):
- tokens/s: 2048 tokens / step time, median over --rounds rounds after a warm-up round. A step
  starts at a barrier; its time is the slowest rank's. Each round runs every (schedule, framework)
  case, rotating the order, so the shared machine's noise hits them alike. ratio = pipetrain tok/s /
  torch tok/s, paired within each round (median and range); CPU ratio = torch's CPU seconds per step
  (summed over ranks) / pipetrain's, which machine load distorts far less than wall time.
- idle fraction per rank: (time in Work.wait() during the step + time between the rank's own end and
  the slowest rank's end) / step time. Every Work.wait() of both frameworks is timed (the method is
  wrapped on the Work class); so are forward (chunk calls), loss, backward (torch.autograd.backward)
  and pipetrain's deferred weight gradients (apply_weight_grads); "other" is the rest of the step.
- ceiling: torch's step time over this run's CPU floor, max(the busiest rank's CPU seconds, all ranks'
  CPU seconds / the cores they share), paired per round: what this run would reach over torch were its
  step as short as its CPU allows, i.e. the most that scheduling alone could buy on this machine.
- expected idle: the formula (p-1)/(v*m+p-1), and replay_idle: the very action lists replayed with this
  partition's stage costs and the measured backward / weight-gradient ratios (deterministic).
- parity: in the warm-up round, the summed loss of each framework and the largest gradient difference
  to torch's.
- memory, in fresh processes per (pp, schedule, framework) running 2 steps: the RSS before the first
  step, the peak RSS (getrusage ru_maxrss: interpreter, torch, parameters, gradients, activations) up to
  the end of step 1 and of step 2 alone, and the peak bytes held for backward in step 2
  (saved_tensors_hooks: distinct storages saved by autograd, parameters excluded; pipetrain's deferred
  weight-gradient operands are counted too, see SavedBytes).

This file is longer than STYLE.md's 300-400 lines: the measurement and the replay model that explains
it stay together so that one command reproduces every figure in docs/benchmarks.md.

Usage: python benchmarks/pipeline.py [--rounds 7] [--pp 2 4] [--schedules ...] [--stage-layers ...] [--no-memory]
       [--json out.json]
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

import pipetrain.parallel.pipeline.executor as executor_mod  # noqa: E402
from pipetrain.config import ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from pipetrain.data import Batch  # noqa: E402
from pipetrain.models import build, materialize  # noqa: E402
from pipetrain.parallel.mesh.dims import ParallelDims  # noqa: E402
from pipetrain.parallel.pipeline.executor import Executor  # noqa: E402
from pipetrain.parallel.pipeline.stage import build_stage, layer_costs, stage_costs, stage_layout  # noqa: E402
from pipetrain.parallel.pipeline.schedules import (B, F, W, build_all_schedules, ideal_bubble, placement_of,  # noqa: E402
                                                   stage_of)
from pipetrain.parallel.pipeline.schedules.builders import zbv_orders  # noqa: E402
from pipetrain.parallel.pipeline.schedules.placement import place  # noqa: E402
from pipetrain.parallel.pipeline.schedules.replay import replay_computes  # noqa: E402
from pipetrain.parallel.pipeline.weight_grads import apply_grad_accumulation_fusion  # noqa: E402
from common import proc_status_bytes  # noqa: E402  (benchmarks/common.py)
from pipetrain.trainer import loss_sum  # noqa: E402

CFG = ModelConfig(family="llama", vocab_size=8192, d_model=256, n_layers=8, n_heads=8, n_kv_heads=4,
                  ffn_hidden=704, max_seq_len=128)
SEQ, MICRO, NUM_MB, SEED = 128, 2, 8, 0
CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zbv", 2), ("dualpipev", 2)]
FRAMEWORKS = ("pipetrain", "pipetrain-split", "pipetrain-unfused", "torch")
# pipetrain's runs: (parallel.split_backward, train.grad_accumulation_fusion)
SPLIT = {"pipetrain": (False, True), "pipetrain-split": (True, True), "pipetrain-unfused": (False, False)}


# ---- where a step's time goes ------------------------------------------------------------------------
KINDS = ("forward", "loss", "backward", "weight", "wait")


class StepClock:
    """Seconds per kind (KINDS) since the last reset; the rest of a step is framework overhead. A timed
    call inside another (the leaf backward inside apply_weight_grads) counts for the outer kind only."""

    def __init__(self):
        self.depth = 0
        self.reset()

    def reset(self) -> None:
        self.totals = dict.fromkeys(KINDS, 0.0)

    def timed(self, kind: str, fn, *args, **kwargs):
        if self.depth:
            return fn(*args, **kwargs)
        self.depth += 1
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.totals[kind] += time.perf_counter() - t0
            self.depth -= 1


def _instrument(clock: StepClock) -> None:
    """Time every backward (both frameworks call torch.autograd.backward; Tensor.backward does too),
    every Work.wait() (both frameworks' p2p) and pipetrain's deferred weight gradients. Benchmark
    processes only."""
    backward = torch.autograd.backward
    torch.autograd.backward = lambda *a, **k: clock.timed("backward", backward, *a, **k)
    work_cls = torch._C._distributed_c10d.Work
    wait = work_cls.wait
    work_cls.wait = lambda self, *a, **k: clock.timed("wait", wait, self, *a, **k)
    weight = executor_mod.apply_weight_grads
    executor_mod.apply_weight_grads = lambda work: clock.timed("weight", weight, work)


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

    def hold(self, t: torch.Tensor) -> int | None:
        """Count t's storage as held (once however many holders); returns the key for release()."""
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.param_ptrs or t.device.type == "meta":
            return None
        entry = self.live.setdefault(ptr, [0, t.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        return ptr

    def pack(self, t: torch.Tensor):
        ptr = self.hold(t)
        return t if ptr is None else _Held(t, self, ptr)

    def count_deferred_weight_work(self) -> None:
        """Also hold the operands pipetrain keeps for its deferred weight gradients (x and dy of each
        linear, from its B until its W): autograd has released them by then, the work list has not."""
        import pipetrain.parallel.pipeline.weight_grads as linear_mod
        backward, apply = linear_mod._LinearFn.backward, executor_mod.apply_weight_grads

        def held_backward(ctx, dy):
            out = backward(ctx, dy)
            if ctx.work is not None:  # deferred, not accumulated at once
                ctx.work[-1] = (*ctx.work[-1], [self.hold(t) for t in ctx.work[-1][2:]])
            return out

        def released_apply(work):
            for entry in work:
                for ptr in entry[4]:
                    if ptr is not None:
                        self.release(ptr)
            apply([entry[:4] for entry in work])
            work.clear()

        linear_mod._LinearFn.backward = staticmethod(held_backward)
        executor_mod.apply_weight_grads = released_apply

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


def _parallel_config(pp: int, schedule: str, v: int) -> ParallelConfig:
    """The layout measured, with --stage-layers' pinned partition if given (passed to the spawned ranks)."""
    pinned = os.environ.get("PIPETRAIN_BENCH_STAGE_LAYERS")
    return ParallelConfig(pp=pp, microbatches=NUM_MB, schedule=schedule, virtual_stages=v,
                          stage_layers=[int(n) for n in pinned.split(",")] if pinned else None)


def _schedules(pcfg: ParallelConfig, split: bool) -> list[list]:
    """Every rank's actions as measured: as build.py builds a run's (zbv ordered on the partition's stage costs),
    or under --zbv-order one of zbv's candidate orders forced (passed to the spawned ranks)."""
    order = os.environ.get("PIPETRAIN_BENCH_ZBV_ORDER", "run")
    zbv = pcfg.schedule == "zbv"
    costs = stage_costs(CFG, pcfg, SEQ) if zbv else None
    if zbv and order != "run":
        return place(zbv_orders(pcfg.pp, NUM_MB, costs)[order], 2, 2.0, True, "v")
    return build_all_schedules(pcfg.schedule, pcfg.pp, NUM_MB, pcfg.virtual_stages, split_backward=split,
                               stage_costs=costs)


def _build_case(dims: ParallelDims, schedule: str, v: int, clock: StepClock):
    """(model, {framework: step function returning this rank's share of the loss}) for one schedule."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                              ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)

    pcfg = _parallel_config(dims.pp, schedule, v)
    model, chunks, specs = build_stage(build(CFG), dims, pcfg, SEQ)
    materialize(model, CFG, SEED, "cpu")
    batch = _batch()
    num_targets = batch.targets.numel()  # random tokens: nothing is ignored
    microbatches = batch.split(NUM_MB)

    _time_forward(model, chunks, clock)

    def loss_fn(logits, targets):  # pipetrain's executor divides by num_targets itself
        return clock.timed("loss", loss_sum, logits, targets)

    executor = Executor(chunks, specs, dims, (MICRO, SEQ, CFG.d_model), torch.float32, loss_fn=loss_fn)
    actions = {fw: _schedules(pcfg, split)[dims.pp_rank] for fw, (split, _) in SPLIT.items()}

    def pipetrain_step(framework: str):
        def step():
            fuse = SPLIT[framework][1]  # the recipe's default threshold, or off
            apply_grad_accumulation_fusion(model, TrainConfig().grad_accumulation_fusion_min_numel if fuse else None)
            return float(executor.run(actions[framework], microbatches, num_targets)) / num_targets
        return step

    # No input_args/output_args, as torchtitan does: torch infers the shapes in the first (warm-up) step.
    stages = [PipelineStage(chunk, spec.stage, dims.pp * v, torch.device("cpu"), group=dims.pp_group)
              for chunk, spec in zip(chunks, specs)]

    def torch_loss_fn(logits, targets):
        return loss_fn(logits, targets) / num_targets

    if schedule == "gpipe":
        sched = ScheduleGPipe(stages[0], NUM_MB, loss_fn=torch_loss_fn, scale_grads=False)
    elif schedule == "1f1b":
        sched = Schedule1F1B(stages[0], NUM_MB, loss_fn=torch_loss_fn, scale_grads=False)
    elif schedule == "zbv":
        sched = ScheduleZBVZeroBubble(stages, NUM_MB, loss_fn=torch_loss_fn, scale_grads=False)
    elif schedule == "dualpipev":
        sched = ScheduleDualPipeV(stages, NUM_MB, loss_fn=torch_loss_fn, scale_grads=False)
    else:
        sched = ScheduleInterleaved1F1B(stages, NUM_MB, loss_fn=torch_loss_fn, scale_grads=False)
    if schedule == "interleaved-1f1b":  # same compute order as pipetrain's, so any difference between the two is in the execution
        theirs = [("F" if a.computation_type.name == "FORWARD" else "B", a.microbatch_index, a.stage_index)
                  for a in sched.pipeline_order[dims.pp_rank] if a is not None and a.computation_type.name in
                  ("FORWARD", "FULL_BACKWARD")]
        for fw in SPLIT:
            ours = [(a.kind, a.microbatch, a.chunk * dims.pp + dims.pp_rank) for a in actions[fw] if a.kind in (F, B)]
            assert theirs == ours, f"{dims.coords} torch's interleaved compute order differs from {fw}'s"
    has_first, has_last = any(s.is_first for s in specs), any(s.is_last for s in specs)

    def torch_step() -> float:
        apply_grad_accumulation_fusion(model, None)  # plain autograd, as nn.Linear
        losses: list[torch.Tensor] = []
        args = (batch.inputs,) if has_first else ()
        sched.step(*args, target=batch.targets if has_last else None, losses=losses, return_outputs=False)
        return sum(float(x.detach()) for x in losses)

    return model, {**{fw: pipetrain_step(fw) for fw in SPLIT}, "torch": torch_step}


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


def _timing_worker(dims: ParallelDims, rounds: int, cases_run: list, out_path: str) -> None:
    clock = StepClock()
    _instrument(clock)
    cases = {(s, v): _build_case(dims, s, v, clock) for s, v in cases_run}
    results = {f"{s}|{fw}": [] for s, _ in cases_run for fw in FRAMEWORKS}
    parity = {}
    for r in range(rounds + 1):
        order = cases_run[r % len(cases_run):] + cases_run[:r % len(cases_run)]
        for s, v in order:
            model, steps = cases[(s, v)]
            if r == 0:  # warm-up: torch infers shapes here; check the frameworks agree on loss and gradients
                rec, grads = {}, {}
                for fw in FRAMEWORKS[::-1]:  # torch first
                    rec[fw] = _timed_step(dims, model, steps[fw], clock)
                    grads[fw] = _grads(model)
                parity[s] = {f"loss_{fw}": rec[fw]["step_loss"] for fw in FRAMEWORKS}
                for fw in SPLIT:
                    diff = max((float((g - grads["torch"][n]).abs().max()) for n, g in grads[fw].items()), default=0.0)
                    scale = max((float(g.abs().max()) for g in grads["torch"].values()), default=0.0)
                    both = torch.tensor([diff, scale], dtype=torch.float64)
                    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=dims.pp_group)
                    parity[s][f"max_grad_diff_{fw}"], parity[s]["max_grad"] = float(both[0]), float(both[1])
                continue
            for fw in (FRAMEWORKS if r % 2 else FRAMEWORKS[::-1]):
                results[f"{s}|{fw}"].append(_timed_step(dims, model, steps[fw], clock))
    if dims.rank == 0:
        with open(out_path, "w") as f:
            json.dump({"steps": results, "parity": parity}, f)


def _memory_worker(dims: ParallelDims, schedule: str, v: int, framework: str, out_path: str) -> None:
    """Peak RSS over the process's life up to the end of step 1 (which also allocates the gradients and,
    for torch, infers shapes), then of step 2 alone: writing 5 to /proc/self/clear_refs resets the
    high-water mark that getrusage reports. Saved-for-backward peak of step 2."""
    clock = StepClock()
    model, steps = _build_case(dims, schedule, v, clock)
    gc.collect()
    before = proc_status_bytes("VmRSS")
    counter = SavedBytes(model.parameters())
    counter.count_deferred_weight_work()
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
def replay_idle(schedule: str, pp: int, v: int, split: bool, backward_ratio: float, weight_ratio: float = 0.0,
                uniform: bool = False) -> list[float]:
    """Per-rank idle fraction of the action lists replayed with this partition's stage costs
    (pipeline.layer_costs; B + W = backward_ratio * F, W = weight_ratio * F) and free transfers, as the
    executor runs them on gloo: each compute starts once its rank is free and its input has been
    produced (receives are waited for at the consuming compute, sends never block), on the schedules'
    own simulator (schedules/replay.py). The formula assumes equal stages; uniform=True replays equal
    stages, where it holds for the unsplit schedules.
    """
    pcfg = _parallel_config(pp, schedule, v)
    layout = stage_layout(CFG, pcfg, SEQ)
    block, embed, head = layer_costs(CFG, SEQ)
    last = len(layout) - 1
    cost_f = [len(ls) * block + (embed if s == 0 else 0.0) + (head if s == last else 0.0) for s, ls in enumerate(layout)]
    placement = placement_of(schedule)
    if uniform:
        cost_f = [1.0] * len(layout)
    orders = [[(a.kind, a.microbatch, a.chunk) for a in actions if a.kind in (F, B, W)]
              for actions in _schedules(pcfg, split)]
    ratio = {F: 1.0, B: backward_ratio - weight_ratio, W: weight_ratio}
    # a B with no W of its own (every B unsplit; first-stage Bs merged back) does the whole backward
    has_w = [{(mb, c) for kind, mb, c in order if kind == W} for order in orders]

    def duration(r: int, x: tuple[str, int, int]) -> float:
        kind, mb, c = x
        return cost_f[stage_of(r, c, pp, placement)] * (backward_ratio if kind == B and (mb, c) not in has_w[r]
                                                        else ratio[kind])

    sim = replay_computes(orders, v, duration, placement)
    assert all(len(sim.ends[r]) == len(orders[r]) for r in range(pp)), f"replay_idle: {schedule} deadlocked"
    busy = [sum(duration(r, x) for x in order) for r, order in enumerate(orders)]
    return [1 - b / max(sim.clock) for b in busy]


def median_ci(values: list[float], resamples: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the median (percentile method; deterministic for a given seed)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.tensor(values, dtype=torch.float64)
    idx = torch.randint(0, len(values), (resamples, len(values)), generator=gen)
    meds = x[idx].median(dim=1).values.sort().values
    return float(meds[int(0.025 * resamples)]), float(meds[int(0.975 * resamples) - 1])


def cpu_floor(cpu: list[float]) -> float:
    """The shortest step a rank's CPU seconds allow: the busiest rank's, or all ranks' over the cores they share."""
    cores = min(len(cpu), len(os.sched_getaffinity(0)))
    return max(max(cpu), sum(cpu) / cores)


def _summary(pp: int, timing: dict, cases: list) -> dict:
    """Medians over rounds: tokens/s, per-rank idle and time breakdown, ratios to torch paired per round."""
    tokens = MICRO * NUM_MB * SEQ
    out = {}
    for s, v in cases:
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
            # tokens/s over torch's = torch's step time / this step time, paired within each round
            ratios = [max(t["seconds"]) / max(r["seconds"]) for r, t in zip(recs, timing["steps"][f"{s}|torch"])]
            # CPU seconds summed over ranks: torch's / this one's, paired; machine load inflates it far less
            cpu_ratios = [sum(t["cpu"]) / sum(r["cpu"]) for r, t in zip(recs, timing["steps"][f"{s}|torch"])]
            # Ceiling: torch's step over the shortest step this run's CPU allows on this machine (no schedule
            # can beat its busiest rank's CPU, nor the ranks' total CPU spread over the cores).
            ceilings = [max(t["seconds"]) / cpu_floor(r["cpu"]) for r, t in zip(recs, timing["steps"][f"{s}|torch"])]
            out[(s, fw)] = {"tokens_per_s": tokens / statistics.median(span), "step_s": statistics.median(span),
                            "idle": [statistics.median(x) for x in idle], "parts": parts,
                            "ratio": statistics.median(ratios), "ratio_range": (min(ratios), max(ratios)),
                            "ratio_ci": median_ci(ratios),
                            "cpu_ratio": statistics.median(cpu_ratios), "ceiling": statistics.median(ceilings)}
        split, whole = out[(s, "pipetrain-split")]["parts"], out[(s, "pipetrain")]["parts"]
        fwd = sum(split["forward"])
        # W / F over the ranks that split (rank 0 may do every backward whole: merged first-stage Ws)
        splitting = [k for k in range(pp) if split["weight"][k] > 0]
        b_ratio = (sum(split["backward"]) + sum(split["weight"])) / fwd
        w_ratio = sum(split["weight"][k] for k in splitting) / sum(split["forward"][k] for k in splitting)
        whole_ratio = sum(whole["backward"]) / sum(whole["forward"])
        out[(s, "model")] = {
            "formula": ideal_bubble(pp, NUM_MB, v), "backward_ratio": b_ratio, "weight_ratio": w_ratio,
            "split": replay_idle(s, pp, v, True, b_ratio, w_ratio), "whole": replay_idle(s, pp, v, False, whole_ratio),
            # equal stages, B = 2F and W = F: the costs the schedules were placed for
            "uniform_split": replay_idle(s, pp, v, True, 2.0, 1.0, uniform=True),
            "uniform_whole": replay_idle(s, pp, v, False, 2.0, uniform=True)}
    return out


def tokens_ceiling(summary: dict, schedule: str, fw: str) -> float:
    """Tokens/s of this (schedule, framework) run were its step as short as its CPU floor (median ceiling x torch's
    tokens/s)."""
    return summary[(schedule, fw)]["ceiling"] * summary[(schedule, "torch")]["tokens_per_s"]


def _name(schedule: str, v: int) -> str:
    return schedule + (f" v{v}" if v > 1 else "")


def _ranks(values, fmt: str = "{:.2f}") -> str:
    return " / ".join(fmt.format(x) for x in values)


def _print_timing(pp: int, rounds: int, summary: dict, parity: dict, cases: list) -> None:
    print(f"\npp {pp}: median of {rounds} rounds; ratio = tok/s / torch tok/s (median of the per-round paired "
          "ratios, [95% bootstrap interval of that median], (min-max)); CPU = "
          "torch CPU s / this CPU s per step, summed over ranks (paired); pipetrain = the default (torch's actions, "
          "weight gradients accumulated in place), split = parallel.split_backward on, unfused = the default with "
          "train.grad_accumulation_fusion off (torch's actions and plain autograd); ceiling = torch's step time / "
          "this run's CPU floor (max(busiest rank's CPU s, all ranks' CPU s / cores)): the most any schedule could "
          "gain over torch's with this run's CPU per step")
    ours = [fw for fw in FRAMEWORKS if fw != "torch"]
    short = {fw: fw.replace("pipetrain-", "") for fw in FRAMEWORKS}
    print("| schedule | " + " | ".join(f"{short[fw]} tok/s" for fw in FRAMEWORKS) + " | " +
          " | ".join(f"{short[fw]} / torch" for fw in ours) + " | CPU " + ", ".join(short[fw] for fw in ours) +
          " | ceiling " + ", ".join(short[fw] for fw in FRAMEWORKS) +
          " | loss " + " / ".join(short.get(fw, fw) for fw in FRAMEWORKS) + " | max grad diff to torch |")
    print("|---|" + "---|" * (2 * len(FRAMEWORKS) + 3))
    for s, v in cases:
        par = parity[s]
        row = [f"{summary[(s, fw)]['tokens_per_s']:.0f}" for fw in FRAMEWORKS]
        row += [f"{summary[(s, fw)]['ratio']:.2f} [{summary[(s, fw)]['ratio_ci'][0]:.2f}-"
                f"{summary[(s, fw)]['ratio_ci'][1]:.2f}] ({summary[(s, fw)]['ratio_range'][0]:.2f}-"
                f"{summary[(s, fw)]['ratio_range'][1]:.2f})" for fw in ours]
        row.append(", ".join(f"{summary[(s, fw)]['cpu_ratio']:.2f}" for fw in ours))
        row.append(", ".join(f"{summary[(s, fw)]['ceiling']:.2f}" for fw in FRAMEWORKS))
        row.append(" / ".join(f"{par[f'loss_{fw}']:.6f}" for fw in FRAMEWORKS))
        row.append(", ".join(f"{par[f'max_grad_diff_{fw}']:.1e}" for fw in ours) + f" (of {par['max_grad']:.1e})")
        print(f"| {_name(s, v)} | " + " | ".join(row) + " |")
    best = {side: max(((s, v, fw) for s, v in cases for fw in FRAMEWORKS if (fw == "torch") == (side == "torch")),
                      key=lambda c: summary[(c[0], c[2])]["tokens_per_s"]) for side in ("pipetrain", "torch")}
    (ps, pv, pfw), (ts, tv, _) = best["pipetrain"], best["torch"]
    ours_best, torch_best = summary[(ps, pfw)]["tokens_per_s"], summary[(ts, "torch")]["tokens_per_s"]
    top = max(tokens_ceiling(summary, s, fw) for s, _ in cases for fw in ours)
    print(f"\npp {pp}: best against best: pipetrain {_name(ps, pv)} ({short[pfw]}) {ours_best:.0f} tok/s / torch "
          f"{_name(ts, tv)} {torch_best:.0f} = {ours_best / torch_best:.2f}x; ceiling (the pipetrain run with the "
          f"shortest CPU floor, at that floor, over torch's best) {top / torch_best:.2f}x")
    print(f"\npp {pp}: idle fraction per rank (rank 0 / rank 1 / ...), measured (waits + tail) and replayed "
          "(replay_idle: this partition's stage costs with the measured ratios; equal stages with B = 2F, W = F)")
    print("| schedule | formula | " + " | ".join(f"measured {fw.replace('pipetrain-', '')}" for fw in FRAMEWORKS) +
          " | replay pipetrain | replay split | equal stages: pipetrain / split | (B+W)/F, W/F measured (split) |")
    print("|---|---|" + "---|" * (len(FRAMEWORKS) + 4))
    for s, v in cases:
        m_ = summary[(s, "model")]
        print(f"| {_name(s, v)} | {m_['formula']:.2f} | " + " | ".join(
            _ranks(summary[(s, fw)]["idle"]) for fw in FRAMEWORKS) +
              f" | {_ranks(m_['whole'])} | {_ranks(m_['split'])} | {_ranks(m_['uniform_whole'])} / "
              f"{_ranks(m_['uniform_split'])} | {m_['backward_ratio']:.2f}, {m_['weight_ratio']:.2f} |")
    print(f"\npp {pp}: ms per step on each rank (rank 0 / rank 1 / ...), wall clock; other = the step minus "
          "the rest (framework bookkeeping, posting p2p ops, allocation); cpu = the process's CPU time")
    columns = KINDS + ("other", "cpu")
    print("| schedule | framework | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for s, v in cases:
        for fw in FRAMEWORKS:
            parts = summary[(s, fw)]["parts"]
            print(f"| {_name(s, v)} | {fw} | " + " | ".join(_ranks([x * 1e3 for x in parts[kind]], "{:.0f}")
                                                          for kind in columns) + " |")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="measured rounds after one warm-up round")
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--no-memory", action="store_true", help="skip the fresh-process memory runs")
    parser.add_argument("--schedules", nargs="+", choices=[s for s, _ in CASES], default=[s for s, _ in CASES])
    parser.add_argument("--json", default=None, help="also write every raw figure to this file")
    parser.add_argument("--zbv-order", choices=["run", "equal", "costed", "fixed"], default="run",
                        help="pipetrain's zbv as a run builds it (the shortest candidate on the partition's stage "
                             "costs), or one candidate: list-scheduled for equal costs, list-scheduled on the "
                             "stage costs, or the paper's fixed order (torch's)")
    parser.add_argument("--stage-layers", type=int, nargs="+", default=None,
                        help="pin parallel.stage_layers (layers per stage) for every case, both frameworks; "
                             "one --pp and schedules with the same stage count")
    args = parser.parse_args()
    if args.stage_layers:
        os.environ["PIPETRAIN_BENCH_STAGE_LAYERS"] = ",".join(map(str, args.stage_layers))
    os.environ["PIPETRAIN_BENCH_ZBV_ORDER"] = args.zbv_order  # read by _build_case in every spawned rank
    print(f"model: llama D {CFG.d_model}, {CFG.n_layers} layers, V {CFG.vocab_size}; m {NUM_MB} microbatches of "
          f"{MICRO} x T {SEQ} = {MICRO * NUM_MB * SEQ} tokens/step; 1 thread per rank, gloo, "
          f"{os.cpu_count()} CPUs", flush=True)
    cases = [(s, v) for s, v in CASES if s in args.schedules]
    raw = {}
    for pp in args.pp:
        t0 = time.perf_counter()
        timing = _spawn(pp, _timing_worker, args.rounds, cases)
        summary = _summary(pp, timing, cases)
        raw[f"pp{pp}"] = {"timing": timing}
        _dump(args.json, raw)
        print(f"\npp {pp} timing took {time.perf_counter() - t0:.0f} s", end="")
        _print_timing(pp, args.rounds, summary, timing["parity"], cases)
        if args.no_memory:
            continue
        mib = 2 ** 20
        print(f"\npp {pp} memory, MiB per rank (rank 0 / rank 1 / ...), fresh processes per row: RSS before the "
              "first step; peak RSS up to the end of step 1; peak RSS of step 2 alone; peak saved for backward "
              "in step 2 (split: with the deferred weight-gradient operands)")
        print("| schedule | framework | RSS before | peak RSS (setup + step 1) | peak RSS (step 2) | saved for backward |")
        print("|---|---|---|---|---|---|")
        for s, v in cases:
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
