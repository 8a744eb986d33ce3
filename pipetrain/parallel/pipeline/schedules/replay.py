"""The one pipeline simulator: ranks do tasks one after another, each starting when its rank is free and
its input has been produced.

Everything that times a schedule runs on it and differs only in the tasks it feeds in and what it reads
back: placing W actions and receives (placement.py: compute orders at reference costs), simulate
(timing.py: action lists with transfer latency) and benchmarks/pipeline.py's replay (this partition's
stage costs). Times are deterministic: a task's start is max(its rank's previous end, its input's
production time), whatever order the ranks are advanced in.
"""
from __future__ import annotations

from typing import Callable, Hashable, NamedTuple, Sequence

from pipetrain.parallel.pipeline.schedules.actions import Compute, source


class Task(NamedTuple):
    """`duration` of work on one rank; it starts no earlier than `needs` was produced (None: no input) and
    produces `makes` (None: nothing another task waits for), available `latency` after it ends."""
    duration: float
    needs: Hashable | None = None
    makes: Hashable | None = None
    latency: float = 0.0


class Replay:
    """Per-rank clocks, what has been produced when, and the start/end of every task each rank has run."""

    def __init__(self, num_ranks: int):
        self.clock = [0.0] * num_ranks
        self.produced: dict[Hashable, float] = {}
        self.starts: list[list[float]] = [[] for _ in range(num_ranks)]
        self.ends: list[list[float]] = [[] for _ in range(num_ranks)]

    def ready(self, task: Task) -> bool:
        """Whether task's input has been produced (it may still land after the rank's clock)."""
        return task.needs is None or task.needs in self.produced

    def run(self, rank: int, task: Task) -> None:
        """Run `task` on `rank` now; its input must have been produced."""
        start = self.clock[rank] if task.needs is None else max(self.clock[rank], self.produced[task.needs])
        end = self.clock[rank] = start + task.duration
        self.starts[rank].append(start)
        self.ends[rank].append(end)
        if task.makes is not None:
            self.produced[task.makes] = end + task.latency

    def drive(self, next_task: Callable[[int], Task | None]) -> None:
        """Advance until no rank can move. Each turn the rank with the earliest clock (ties: the lower rank)
        whose next_task(rank) returns a task runs it, so a policy deciding at time t has seen everything
        produced before t. next_task returns None when the rank is done or its next input has not been
        produced; returning a task commits to running it."""
        ranks = range(len(self.clock))
        while True:
            for r in sorted(ranks, key=self.clock.__getitem__):  # stable: ties keep the lower rank first
                task = next_task(r)
                if task is not None:
                    self.run(r, task)
                    break
            else:
                return


def replay(tasks: Sequence[Sequence[Task]]) -> Replay:
    """Run every rank's task list in order. A rank left with fewer starts than tasks was stuck waiting."""
    sim = Replay(len(tasks))

    def next_task(r: int) -> Task | None:
        i = len(sim.ends[r])
        return tasks[r][i] if i < len(tasks[r]) and sim.ready(tasks[r][i]) else None

    sim.drive(next_task)
    return sim


def replay_computes(orders: Sequence[Sequence[Compute]], virtual_stages: int,
                    duration: Callable[[int, Compute], float], placement: str = "loop") -> Replay:
    """Every rank's compute order with free transfers: a compute waits for the one it consumes
    (actions.source) and produces the key (rank, compute)."""
    p = len(orders)
    return replay([[Task(duration(r, x), needs=source(p, virtual_stages, r, x, placement), makes=(r, x)) for x in order]
                   for r, order in enumerate(orders)])
