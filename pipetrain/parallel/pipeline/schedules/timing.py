"""simulate: time a schedule's action lists on the simulator (replay.py) with given costs.

Every rank's actions run under the "async" semantics of validate.py: F, B and W take time, a SEND_* is
posted instantly and its data lands cost_comm later, a RECV_* is posted when its rank reaches it and
completes once its data has landed. Costs are per microbatch for a rank's whole share of the layers, so
a chunk of an interleaved schedule costs 1/v of them and makespans compare across schedules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pipetrain.parallel.pipeline.schedules.actions import COMPUTE_KINDS, F, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, W, Action
from pipetrain.parallel.pipeline.schedules.replay import Task, replay
from pipetrain.parallel.pipeline.schedules.validate import pair_messages, peak_in_flight


@dataclass(frozen=True)
class SimResult:
    """Per-rank start/end time of every action (same indexing as `schedules`) and the derived figures."""
    schedules: list[list[Action]]
    starts: list[list[float]]
    ends: list[list[float]]
    makespan: float               # time at which the last rank finishes
    bubble_per_rank: list[float]  # fraction of the makespan each rank spends not computing
    bubble: float                 # idle fraction over all ranks: 1 - total compute / (p * makespan)
    peak_in_flight: list[int]     # most (microbatch, chunk) activations held at once, per rank
    virtual_stages: int


def simulate(schedules: Sequence[Sequence[Action]], cost_f: float = 1.0, cost_b: float = 2.0,
             cost_comm: float = 0.0, virtual_stages: int | None = None, cost_w: float | None = None,
             placement: str = "loop") -> SimResult:
    """Replay all ranks' actions with the given costs; raises ValueError if sends and receives do not pair
    up or the schedule deadlocks. virtual_stages defaults to 1 + the largest chunk used. A B with a W
    action of its own (split backward) costs cost_b - cost_w and the W cost_w (default cost_b / 2), so a
    microbatch costs cost_f + cost_b either way. placement: the stages' placement (actions.placement_of)."""
    p = len(schedules)
    v = virtual_stages or 1 + max((a.chunk for actions in schedules for a in actions), default=0)
    cost_w = cost_b / 2 if cost_w is None else cost_w
    if not 0 <= cost_w <= cost_b:
        raise ValueError(f"simulate: cost_w={cost_w} must be in [0, cost_b={cost_b}]")
    split = [{(a.microbatch, a.chunk) for a in actions if a.kind == W} for actions in schedules]

    def cost(r: int, a: Action) -> float:
        if a.kind == F:
            return cost_f / v
        if a.kind == W:
            return cost_w / v
        return (cost_b - cost_w if (a.microbatch, a.chunk) in split[r] else cost_b) / v

    match = pair_messages(schedules, p, placement)

    def task(r: int, i: int, a: Action) -> Task:
        if a.kind in (SEND_ACT, SEND_GRAD):  # lands at the matching receive, keyed (rank, index)
            return Task(0.0, makes=match[(r, i)], latency=cost_comm)
        if a.kind in (RECV_ACT, RECV_GRAD):
            return Task(0.0, needs=(r, i))
        return Task(cost(r, a))

    sim = replay([[task(r, i, a) for i, a in enumerate(actions)] for r, actions in enumerate(schedules)])
    stuck = [f"rank {r} at action {len(sim.ends[r])} {schedules[r][len(sim.ends[r])]}"
             for r in range(p) if len(sim.ends[r]) < len(schedules[r])]
    if stuck:
        raise ValueError("simulate: deadlock: " + "; ".join(stuck))
    def start(r: int, i: int, a: Action) -> float:  # a receive starts when its rank reaches it, then waits
        if a.kind not in (RECV_ACT, RECV_GRAD):
            return sim.starts[r][i]
        return sim.ends[r][i - 1] if i else 0.0

    starts = [[start(r, i, a) for i, a in enumerate(actions)] for r, actions in enumerate(schedules)]
    makespan = max(sim.clock, default=0.0)
    busy = [sum(cost(r, a) for a in actions if a.kind in COMPUTE_KINDS) for r, actions in enumerate(schedules)]
    return SimResult(schedules=[list(a) for a in schedules], starts=starts, ends=sim.ends, makespan=makespan,
                     bubble_per_rank=[1 - b / makespan if makespan else 0.0 for b in busy],
                     bubble=1 - sum(busy) / (p * makespan) if makespan else 0.0,
                     peak_in_flight=[peak_in_flight(a) for a in schedules], virtual_stages=v)


def ideal_bubble(pp_size: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Textbook bubble fraction (p-1)/(v*m + p-1) of GPipe/1F1B (v=1) and interleaved 1F1B."""
    return (pp_size - 1) / (virtual_stages * num_microbatches + pp_size - 1)
