"""Dynamic batch sizing across data-parallel replicas (parallel.dynamic_batch; docs/relaxed_sync.md).

After Ye et al., "DBS: Dynamic Batch Size for Distributed Deep Neural Network Training". The global
batch of a step is cut into microbatches of a fixed size (train.global_batch / dp / parallel.microbatches
samples). Statically every dp rank takes parallel.microbatches of them. With DBS, replica r (dp_shard
ranks x tp x pp) takes counts[r] microbatches on each of its dp ranks, counts[r] apportioned from the
replicas' measured speed, so they finish a step together. Only where samples are processed changes:
the samples of step k are still global samples k*GB .. k*GB+GB-1 (replica r takes the contiguous run
after replicas 0..r-1), the loss is still normalised by the global batch's target tokens, so a bsp run
gives the static run's loss at every step to round-off.

Measurement: each rank times its step's compute (forward and backward, with injected straggler delay;
not the wait for gradients) and divides it by the pipeline's length in microbatch slots,
counts[r] + pp - 1 (a 1F1B or GPipe step of k microbatches takes about k + pp - 1 slots). The slowest
rank of a replica sets the replica's time per slot (a max over the world, agreed by the trainer).

Damping, so transient noise does not make the split chase its tail (benchmarks/dbs.py measures it):
- every parallel.dynamic_batch_every steps, the time per slot of each replica is the median over those
  steps: one slow step in five moves nothing (a straggler hitting 3 of 5 steps with probability 0.2 per
  step happens 6% of the time);
- a new split is adopted only when its predicted step time, max over r of slot_r * (counts[r] + pp - 1),
  beats the current split's prediction by more than DBS_GAIN (10%) in DBS_WINDOWS (2) windows in a row.
  With 4 replicas on 2 shared cores, single windows predicted gains above 5% from noise alone, and
  under ssp the split moved at nearly every window and cost 11% (benchmarks/dbs.py); a persistent
  straggler passes both tests at once, at the cost of one window's delay.
The new split is proportional to speed (1 / time per slot), in largest-remainder integers, every replica
keeping at least the schedule's minimum, counts a multiple of pp for interleaved-1f1b
(pipetrain.parallel.mesh.rules.count_rules).
"""
from __future__ import annotations

import math
import statistics
from typing import Sequence

DBS_GAIN = 0.10  # a new split must predict a step this much shorter than the current one ...
DBS_WINDOWS = 2  # ... in this many measurement windows in a row


def apportion(weights: Sequence[float], total: int, minimum: int = 1) -> list[int]:
    """Integers >= minimum summing to total, proportional to weights (largest remainder; ties go to the
    lower index). A share whose proportional quota falls below minimum is held at minimum and the rest is
    shared among the others. Deterministic: the same floats give the same split on every rank."""
    n = len(weights)
    assert n >= 1 and total >= n * minimum, f"cannot give {n} replicas {minimum} each out of {total}"
    w = [max(float(x), 0.0) if math.isfinite(x) else 0.0 for x in weights]
    if sum(w) <= 0:
        w = [1.0] * n
    held: set[int] = set()
    while True:
        free = [i for i in range(n) if i not in held]
        budget = total - minimum * len(held)
        mass = sum(w[i] for i in free)
        quota = {i: budget * w[i] / mass if mass > 0 else budget / len(free) for i in free}
        low = [i for i in free if quota[i] < minimum]
        if not low:
            break
        held.update(low)
    counts = [minimum] * n
    for i in free:
        counts[i] = int(math.floor(quota[i]))
    left = total - sum(counts)
    for i in sorted(free, key=lambda i: (-(quota[i] - counts[i]), i))[:left]:
        counts[i] += 1
    return counts


class DynamicBatch:
    """The replicas' microbatch counts and the measurements that move them. Every rank holds one, fed the
    same agreed measurements, so every rank computes the same counts."""

    def __init__(self, replicas: int, microbatches: int, every: int, pp: int, granule: int, minimum: int,
                 counts: Sequence[int] | None = None):
        self.replicas, self.microbatches, self.every, self.pp = replicas, microbatches, every, pp
        self.granule, self.minimum = granule, minimum
        self.total = replicas * microbatches
        self.counts = list(counts) if counts is not None else [microbatches] * replicas
        assert self.valid(self.counts), f"invalid microbatch counts {self.counts}"
        self.window: list[list[float]] = []  # per observed step: seconds per slot of each replica
        self.changes = 0
        self.streak = 0  # windows in a row whose proposal gained more than DBS_GAIN

    def valid(self, counts: Sequence[int]) -> bool:
        return (len(counts) == self.replicas and sum(counts) == self.total
                and all(isinstance(k, int) and k >= self.minimum and k % self.granule == 0 for k in counts))

    def slots(self, count: int) -> int:
        """Microbatch slots a pipeline of `count` microbatches takes (count + pp - 1)."""
        return count + self.pp - 1

    def observe(self, slot_seconds: Sequence[float]) -> None:
        """One step's agreed seconds per slot of each replica (0: not measured)."""
        if all(s > 0 for s in slot_seconds):
            self.window.append([float(s) for s in slot_seconds])

    def predicted(self, counts: Sequence[int], slot: Sequence[float]) -> float:
        return max(t * self.slots(k) for t, k in zip(slot, counts))

    def propose(self, slot: Sequence[float]) -> list[int]:
        """The split proportional to speed 1/slot, in granules, each at least the minimum."""
        g = self.granule
        units = apportion([1.0 / t for t in slot], self.total // g, self.minimum // g)
        return [u * g for u in units]

    def update(self) -> bool:
        """At the end of a window of `every` observed steps: adopt this window's split when it, and the
        windows' before it, predicted a step more than DBS_GAIN shorter DBS_WINDOWS times in a row.
        Returns whether the counts changed."""
        if len(self.window) < self.every:
            return False
        slot = [statistics.median(step[r] for step in self.window) for r in range(self.replicas)]
        self.window = []
        proposal = self.propose(slot)
        gains = proposal != self.counts and \
            self.predicted(proposal, slot) < (1 - DBS_GAIN) * self.predicted(self.counts, slot)
        self.streak = self.streak + 1 if gains else 0
        if self.streak < DBS_WINDOWS:
            return False
        self.counts, self.streak = proposal, 0
        self.changes += 1
        return True
