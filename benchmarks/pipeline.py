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
  starts at a barrier; its time is the slowest rank's. Each round runs every (schedule, framework)
  case, rotating the order, so the shared machine's noise hits them alike. ratio = pipetrain tok/s /
  torch tok/s, paired within each round (median and range); CPU ratio = torch's CPU seconds per step
  (summed over ranks) / pipetrain's, which machine load distorts far less than wall time.
- idle fraction per rank: (time in Work.wait() during the step + time between the rank's own end and
  the slowest rank's end) / step time. pipetrain's waits are timed by TimedExecutor (the executor's
  torch.distributed calls go through a proxy whose Works time wait()); torch's by wrapping
  torch.distributed.pipelining.schedules._wait_batch_p2p. Forward (chunk calls), loss and backward
  (torch.autograd.backward) are timed too; "other" is the rest of the step.
- expected idle: the formula (p-1)/(v*m+p-1), and replay_idle: the very action lists replayed with this
  partition's stage costs under three execution models (pipetrain's executor on gloo, the same waiting
  only for receives, pure dataflow as torch's interleaved runtime), deterministic.
- parity: in the warm-up round, the summed loss of both frameworks and the largest gradient difference.
- memory, in fresh processes per (pp, schedule, framework) running 2 steps: the RSS before the first
  step, the peak RSS (getrusage ru_maxrss: interpreter, torch, parameters, gradients, activations) up to
  the end of step 1 and of step 2 alone, and the peak bytes held for backward in step 2
  (saved_tensors_hooks: distinct storages saved by autograd, parameters excluded).
- --variants: two benchmark-only executor variants (_TimedDist), to measure proposed executor changes
  without editing executor.py.

This file is longer than STYLE.md's 300-400 lines: the measurement, the replay model that explains it
and the executor variants stay together so that one command reproduces every figure in
docs/benchmarks.md.

Usage: python benchmarks/pipeline.py [--rounds 7] [--pp 2 4] [--schedules ...] [--no-memory] [--variants]
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

import pipetrain.parallel.executor as executor_mod  # noqa: E402
from pipetrain.config import ModelConfig, ParallelConfig  # noqa: E402
from pipetrain.data import Batch  # noqa: E402
from pipetrain.models import build, materialize  # noqa: E402
from pipetrain.parallel.dims import ParallelDims  # noqa: E402
from pipetrain.parallel.executor import Executor  # noqa: E402
from pipetrain.parallel.pipeline import build_stage, layer_costs, stage_layout  # noqa: E402
from pipetrain.parallel.schedule_sim import ideal_bubble  # noqa: E402
from pipetrain.parallel.schedules import (B, F, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD,  # noqa: E402
                                          build_all_schedules, build_schedule)
from pipetrain.trainer import loss_sum  # noqa: E402

CFG = ModelConfig(family="llama", vocab_size=8192, d_model=256, n_layers=8, n_heads=8, n_kv_heads=4,
                  ffn_hidden=704, max_seq_len=128)
SEQ, MICRO, NUM_MB, SEED = 128, 2, 8, 0
CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)]
FRAMEWORKS = ("pipetrain", "torch")
VARIANTS = ("pipetrain defer-sends", "pipetrain prefetch")  # --variants: see _TimedDist
REPLAYS = ("executor", "deferred", "dataflow")  # execution models of replay_idle


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
    """A Work whose wait() is timed; `after` runs once the wait returns (copying a prefetched receive)."""

    def __init__(self, work, clock: StepClock, after=None):
        self._work, self._clock, self._after = work, clock, after

    def wait(self):
        if self._work is not None:
            self._clock.timed_wait(self._work)
        if self._after is not None:
            self._after()
            self._after = None
        return True


class _TimedDist:
    """torch.distributed as the executor sees it, except for batch_isend_irecv, whose Works time wait().

    Two executor variants, to measure changes proposed for executor.py without editing it:
    - defer_sends: in a batch that also receives, the executor waits only for the receives; the sends
      are waited at the end of the step (gloo sends progress on their own, so this is the "async"
      semantics of schedules.py, which every schedule is proven deadlock-free under).
    - prefetch: each receive from a peer is posted as soon as the previous receive from that peer has
      been posted (so one receive per peer is always outstanding ahead of the executor), into a buffer
      of the agreed shape that is copied into the executor's buffer when it waits. Receives from one
      peer stay in order, so messages still pair up as the schedule says.
    """

    def __init__(self, clock: StepClock, defer_sends: bool = False, prefetch: dict | None = None,
                 shape=None, dtype=None):
        self._clock, self._defer_sends = clock, defer_sends
        self.deferred: list = []
        self._to_receive = dict(prefetch or {})  # peer -> receives not yet posted
        self._ahead: dict[int, list] = {peer: [] for peer in self._to_receive}
        self._prefetch, self._shape, self._dtype = prefetch is not None, shape, dtype

    def __getattr__(self, name):
        return getattr(dist, name)

    def _post_recv(self, peer: int) -> None:
        buf = torch.empty(self._shape, dtype=self._dtype)
        self._ahead[peer].append((buf, dist.irecv(buf, peer)))
        self._to_receive[peer] -= 1

    def batch_isend_irecv(self, ops):
        if not (self._defer_sends or self._prefetch):
            return [_TimedWork(w, self._clock) for w in dist.batch_isend_irecv(ops)]
        has_recv = any(op.op is dist.irecv for op in ops)
        works = []
        for op in ops:
            if op.op is dist.isend:
                work = dist.isend(op.tensor, op.peer)
                if self._defer_sends and has_recv:
                    self.deferred.append(work)
                    work = None
                works.append(_TimedWork(work, self._clock))
            elif self._prefetch:
                if not self._ahead[op.peer]:
                    self._post_recv(op.peer)
                buf, work = self._ahead[op.peer].pop(0)
                works.append(_TimedWork(work, self._clock, after=lambda dst=op.tensor, src=buf: dst.copy_(src)))
            else:
                works.append(_TimedWork(dist.irecv(op.tensor, op.peer), self._clock))
        for peer, left in self._to_receive.items():
            if left and not self._ahead[peer]:
                self._post_recv(peer)
        return works


class TimedExecutor(Executor):
    """pipetrain's Executor with its waits timed (and optionally a _TimedDist variant); the executor
    module itself is left untouched."""

    def __init__(self, *args, clock: StepClock, variant: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self.clock, self.variant = clock, variant

    def run(self, actions, *args, **kwargs):
        prefetch = None
        if self.variant == "prefetch":
            prefetch = {}
            for a in actions:
                if a.kind in (RECV_ACT, RECV_GRAD):
                    peer = self._peer(a.peer)
                    prefetch[peer] = prefetch.get(peer, 0) + 1
        proxy = _TimedDist(self.clock, defer_sends=self.variant == "defer-sends", prefetch=prefetch,
                           shape=self.act_shape, dtype=self.act_dtype)
        saved = executor_mod.dist
        executor_mod.dist = proxy
        try:
            out = super().run(actions, *args, **kwargs)
        finally:
            executor_mod.dist = saved
        for work in proxy.deferred:
            self.clock.timed_wait(work)
        return out


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

    actions = build_schedule(schedule, dims.pp_rank, dims.pp, NUM_MB, v)

    def pipetrain_step(variant: str = ""):
        executor = TimedExecutor(chunks, specs, dims, (MICRO, SEQ, CFG.d_model), torch.float32,
                                 loss_fn=loss_fn, clock=clock, variant=variant)
        return lambda: float(executor.run(actions, microbatches, num_targets)) / num_targets

    # No input_args/output_args, as torchtitan does: torch infers the shapes in the first (warm-up) step.
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
        # Same compute order as pipetrain's, so any difference between the two is in the execution.
        theirs = [("F" if a.computation_type.name == "FORWARD" else "B", a.microbatch_index, a.stage_index)
                  for a in sched.pipeline_order[dims.pp_rank] if a is not None and a.computation_type.name in
                  ("FORWARD", "FULL_BACKWARD")]
        ours = [(a.kind, a.microbatch, a.chunk * dims.pp + dims.pp_rank) for a in actions if a.kind in (F, B)]
        assert theirs == ours, f"{dims.coords} torch's interleaved compute order differs from pipetrain's"
    has_first, has_last = any(s.is_first for s in specs), any(s.is_last for s in specs)

    def torch_step() -> float:
        losses: list[torch.Tensor] = []
        args = (batch.inputs,) if has_first else ()
        sched.step(*args, target=batch.targets if has_last else None, losses=losses, return_outputs=False)
        return sum(float(x.detach()) for x in losses)

    steps = {"pipetrain": pipetrain_step(), "torch": torch_step}
    steps.update({name: pipetrain_step(name.split()[1]) for name in VARIANTS})
    return model, steps


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


def _timing_worker(dims: ParallelDims, rounds: int, frameworks: tuple[str, ...], cases_run: list, out_path: str) -> None:
    clock = StepClock()
    _instrument(clock)
    cases = {(s, v): _build_case(dims, s, v, clock) for s, v in cases_run}
    results = {f"{s}|{fw}": [] for s, _ in cases_run for fw in frameworks}
    parity = {}
    for r in range(rounds + 1):
        order = cases_run[r % len(cases_run):] + cases_run[:r % len(cases_run)]
        for s, v in order:
            model, steps = cases[(s, v)]
            if r == 0:  # warm-up: torch infers shapes here; check the two agree on loss and gradients
                rec = {"pipetrain": _timed_step(dims, model, steps["pipetrain"], clock)}
                grads = _grads(model)
                rec["torch"] = _timed_step(dims, model, steps["torch"], clock)
                diff = max((float((p.grad - grads[n]).abs().max()) for n, p in model.named_parameters()
                            if p.grad is not None), default=0.0)
                scale = max((float(g.abs().max()) for g in grads.values()), default=0.0)
                both = torch.tensor([diff, scale], dtype=torch.float64)
                dist.all_reduce(both, op=dist.ReduceOp.MAX, group=dims.pp_group)
                parity[s] = {"loss_pipetrain": rec["pipetrain"]["step_loss"], "loss_torch": rec["torch"]["step_loss"],
                             "max_grad_diff": float(both[0]), "max_grad": float(both[1])}
                for fw in frameworks[2:]:  # warm the variants up too
                    _timed_step(dims, model, steps[fw], clock)
                continue
            for fw in (frameworks if r % 2 else frameworks[::-1]):
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
def replay_idle(schedule: str, pp: int, v: int, backward_ratio: float, mode: str, uniform: bool = False) -> list[float]:
    """Per-rank idle fraction of the schedule replayed with this partition's stage costs (pipeline.layer_costs,
    B = backward_ratio * F) and free transfers. The formula assumes equal stages; this is the bubble to expect
    from this partition (uniform=True: equal stages, where the formula holds), under one of three execution
    models:
    - "executor": pipetrain's executor on gloo. A run of consecutive comm actions is posted at once; if it
      holds a receive, the rank waits for every op in it, and a gloo send completes only once the peer has
      posted the matching receive (measured: an isend waits for the irecv). Send-only runs do not wait.
    - "deferred": the same, except that a run waits only for its receives (sends are completed at the end of
      the step): the "async" semantics of schedules.py.
    - "dataflow": each compute starts as soon as its rank is free and its input exists (receives posted
      early and waited right before the compute, sends never waited), which is how torch's
      _PipelineScheduleRuntime (interleaved) runs; the compute orders of both frameworks are the same.
    """
    layout = stage_layout(CFG, ParallelConfig(pp=pp, microbatches=NUM_MB, schedule=schedule, virtual_stages=v), SEQ)
    block, embed, head = layer_costs(CFG, SEQ)
    last = len(layout) - 1
    cost_f = [len(ls) * block + (embed if s == 0 else 0.0) + (head if s == last else 0.0) for s, ls in enumerate(layout)]
    if uniform:
        cost_f = [1.0] * len(layout)
    lists = build_all_schedules(schedule, pp, NUM_MB, v)
    steps = []  # per rank: [compute action] or [run of comm actions]
    for actions in lists:
        rank_steps: list[list] = []
        for a in actions:
            if a.kind not in (F, B) and rank_steps and rank_steps[-1][0].kind not in (F, B):
                rank_steps[-1].append(a)
            else:
                rank_steps.append([a])
        if mode == "dataflow":
            rank_steps = [st for st in rank_steps if st[0].kind in (F, B)]
        steps.append(rank_steps)

    def message(a, rank: int):  # (payload, microbatch, receiving stage): the same on both ends
        stage = a.chunk * pp + rank
        dst = {SEND_ACT: stage + 1, SEND_GRAD: stage - 1}.get(a.kind, stage)
        return a.kind[-3:], a.microbatch, dst

    done: dict[tuple, float] = {}                # dataflow: (kind, microbatch, stage) -> end time
    posted: dict[tuple, float] = {}              # executor: (side, message) -> time the op was posted
    pos, clock, busy = [0] * pp, [0.0] * pp, [0.0] * pp
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while pos[r] < len(steps[r]):
                step = steps[r][pos[r]]
                a = step[0]
                if a.kind in (F, B):
                    stage = a.chunk * pp + r
                    start = clock[r]
                    if mode == "dataflow":
                        src = (a.kind, a.microbatch, stage - 1 if a.kind == F else stage + 1)
                        if 0 <= src[2] <= last:
                            if src not in done:
                                break
                            start = max(start, done[src])
                    dt = cost_f[stage] * (1.0 if a.kind == F else backward_ratio)
                    clock[r] = done[(a.kind, a.microbatch, stage)] = start + dt
                    busy[r] += dt
                else:
                    for c in step:
                        posted.setdefault(("send" if c.kind.startswith("SEND") else "recv", message(c, r)), clock[r])
                    if any(c.kind in (RECV_ACT, RECV_GRAD) for c in step):
                        peers = [("recv" if c.kind.startswith("SEND") else "send", message(c, r)) for c in step
                                 if mode == "executor" or c.kind in (RECV_ACT, RECV_GRAD)]
                        if any(p not in posted for p in peers):
                            break
                        clock[r] = max([clock[r]] + [posted[p] for p in peers])
                pos[r] += 1
                progress = True
    assert all(pos[r] == len(steps[r]) for r in range(pp)), f"replay_idle: {schedule} deadlocked under {mode}"
    return [1 - b / max(clock) for b in busy]


def _summary(pp: int, timing: dict, frameworks: tuple[str, ...], cases: list) -> dict:
    """Medians over rounds: tokens/s, per-rank idle and time breakdown, ratios to torch paired per round."""
    tokens = MICRO * NUM_MB * SEQ
    out = {}
    for s, v in cases:
        for fw in frameworks:
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
            out[(s, fw)] = {"tokens_per_s": tokens / statistics.median(span), "step_s": statistics.median(span),
                            "idle": [statistics.median(x) for x in idle], "parts": parts,
                            "ratio": statistics.median(ratios), "ratio_range": (min(ratios), max(ratios)),
                            "cpu_ratio": statistics.median(cpu_ratios)}
        p_parts = out[(s, "pipetrain")]["parts"]
        backward_ratio = sum(p_parts["backward"]) / sum(p_parts["forward"])
        out[(s, "model")] = {"formula": ideal_bubble(pp, NUM_MB, v), "backward_ratio": backward_ratio,
                             # equal stages with B = 2F, the ratio the schedules placed their receives for
                             **{f"uniform_{mode}": replay_idle(s, pp, v, 2.0, mode, uniform=True) for mode in REPLAYS},
                             **{mode: replay_idle(s, pp, v, backward_ratio, mode) for mode in REPLAYS}}
    return out


def _name(schedule: str, v: int) -> str:
    return schedule + (f" v{v}" if v > 1 else "")


def _ranks(values, fmt: str = "{:.2f}") -> str:
    return " / ".join(fmt.format(x) for x in values)


def _print_timing(pp: int, rounds: int, summary: dict, parity: dict, frameworks: tuple[str, ...], cases: list) -> None:
    print(f"\npp {pp}: median of {rounds} rounds; ratio = pipetrain tok/s / torch tok/s (paired per round); CPU "
          "ratio = torch CPU s / pipetrain CPU s per step, summed over ranks (paired); idle "
          "per rank (rank 0 / rank 1 / ...); formula (p-1)/(v*m+p-1); replayed = the schedule replayed with "
          "this partition's cost-model stage costs and the measured B/F ratio, as pipetrain's executor runs it / "
          "as pure dataflow (replay_idle)")
    print("| schedule | pipetrain tok/s | torch tok/s | ratio (min-max) | CPU ratio | idle pipetrain | idle torch | "
          "formula | replayed executor | replayed dataflow | loss pipetrain / torch | max grad diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s, v in cases:
        p_, t_, m_, par = summary[(s, "pipetrain")], summary[(s, "torch")], summary[(s, "model")], parity[s]
        lo, hi = p_["ratio_range"]
        print(f"| {_name(s, v)} | {p_['tokens_per_s']:.0f} | {t_['tokens_per_s']:.0f} | {p_['ratio']:.2f} "
              f"({lo:.2f}-{hi:.2f}) | {p_['cpu_ratio']:.2f} | "
              f"{_ranks(p_['idle'])} | {_ranks(t_['idle'])} | {m_['formula']:.2f} | {_ranks(m_['executor'])} | "
              f"{_ranks(m_['dataflow'])} | "
              f"{par['loss_pipetrain']:.6f} / {par['loss_torch']:.6f} | "
              f"{par['max_grad_diff']:.1e} (of {par['max_grad']:.1e}) |")
    print(f"\npp {pp}: idle per rank predicted by replay_idle (deterministic), with equal stages (B = 2F) and with "
          "this partition's stages (B/F measured: " + ", ".join(f"{s} {summary[(s, 'model')]['backward_ratio']:.2f}"
                                                               for s, _ in cases) + "); executor = as pipetrain's executor runs on gloo, deferred = the same waiting only "
          "for receives, dataflow = receives posted early and waited at the compute (torch's interleaved runtime)")
    print("| schedule | formula | equal: executor | equal: deferred | equal: dataflow | partition: executor | "
          "partition: deferred | partition: dataflow |")
    print("|---|---|---|---|---|---|---|---|")
    for s, v in cases:
        m_ = summary[(s, "model")]
        print(f"| {_name(s, v)} | {m_['formula']:.3f} | " + " | ".join(
            _ranks(m_[f"{costs}{mode}"], "{:.3f}") for costs in ("uniform_", "") for mode in REPLAYS) + " |")
    if len(frameworks) > 2:
        print(f"\npp {pp}: executor variants (benchmark-only, see _TimedDist): tok/s (ratio to torch, CPU ratio)")
        print("| schedule | " + " | ".join(frameworks) + " |")
        print("|---|" + "---|" * len(frameworks))
        for s, v in cases:
            print(f"| {_name(s, v)} | " + " | ".join(f"{summary[(s, fw)]['tokens_per_s']:.0f} "
                                                    f"({summary[(s, fw)]['ratio']:.2f}, CPU "
                                                    f"{summary[(s, fw)]['cpu_ratio']:.2f})" for fw in frameworks) + " |")
    print(f"\npp {pp}: ms per step on each rank (rank 0 / rank 1 / ...), wall clock; other = the step minus "
          "the rest (framework bookkeeping, posting p2p ops, allocation); cpu = the process's CPU time")
    columns = KINDS + ("other", "cpu")
    print("| schedule | framework | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for s, v in cases:
        for fw in frameworks:
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
    parser.add_argument("--variants", action="store_true",
                        help=f"also time the benchmark-only executor variants {', '.join(VARIANTS)}")
    parser.add_argument("--json", default=None, help="also write every raw figure to this file")
    args = parser.parse_args()
    print(f"model: llama D {CFG.d_model}, {CFG.n_layers} layers, V {CFG.vocab_size}; m {NUM_MB} microbatches of "
          f"{MICRO} x T {SEQ} = {MICRO * NUM_MB * SEQ} tokens/step; 1 thread per rank, gloo, "
          f"{os.cpu_count()} CPUs", flush=True)
    cases = [(s, v) for s, v in CASES if s in args.schedules]
    raw = {}
    for pp in args.pp:
        t0 = time.perf_counter()
        frameworks = FRAMEWORKS + (VARIANTS if args.variants else ())
        timing = _spawn(pp, _timing_worker, args.rounds, frameworks, cases)
        summary = _summary(pp, timing, frameworks, cases)
        raw[f"pp{pp}"] = {"timing": timing}
        _dump(args.json, raw)
        print(f"\npp {pp} timing took {time.perf_counter() - t0:.0f} s", end="")
        _print_timing(pp, args.rounds, summary, timing["parity"], frameworks, cases)
        if args.no_memory:
            continue
        mib = 2 ** 20
        print(f"\npp {pp} memory, MiB per rank (rank 0 / rank 1 / ...), fresh processes per row: RSS before the "
              "first step; peak RSS up to the end of step 1; peak RSS of step 2 alone; peak saved for backward "
              "in step 2")
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
