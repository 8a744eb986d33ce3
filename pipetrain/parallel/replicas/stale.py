"""Stale-synchronous parallel across data-parallel replicas: parallel.dp_sync ssp and dssp
(docs/relaxed_sync.md; the replica groups and the bsp exchange this builds on: wrapped.py).

- ssp (staleness s): at clock c a rank starts an async all-reduce of its replica gradient of clock c,
  then waits for the all-reduces of every clock <= c - s and applies those summed gradients, oldest first,
  each with the learning rate of its own clock. Every replica applies the same updates at the same clocks,
  so replicas are bitwise identical and the trajectory does not depend on timing; a replica at clock c
  has applied every update of clocks <= c - s - 1 (indeed <= c - s) and, because the all-reduce of
  clock c - s needs every replica to have reached it, never runs more than s clocks ahead of the slowest.
  s = 0 is bsp: it takes bsp's path (wrapped.sync_mode, wrapped.ReplicaOptimizer), so it is bsp bitwise.
- dssp (staleness_min .. staleness): as ssp with bound staleness, but at clock c the updates of clocks
  in (c - staleness, c - staleness_min] are applied too when they are complete, or when the predicted
  wait for them is short (under half this replica's mean step time). The prediction uses the clocks the
  replicas publish: every gradient all-reduce carries, beside it, a small float64 all-reduce of each
  replica's (wall time at that clock, mean step time); so publication costs no extra round trip and
  needs no TCPStore, at the price of being as stale as the newest completed exchange. The decision is
  agreed inside the replica (a max over the replica group), so its ranks apply the same updates.
  Replicas still apply the same updates in the same order; only when depends on timing.

Checkpoints call drain() first: the pending updates are applied (this changes the run: docs/relaxed_sync.md
says how); the checkpoint then holds the wrapped optimizer's state under its plain names.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from pipetrain.config import ParallelConfig, TrainConfig
from pipetrain.parallel.data.flat import flatten
from pipetrain.parallel.mesh.comm import all_reduce_async, all_reduce_max_, group_device
from pipetrain.parallel.replicas.wrapped import ReplicaOptimizer, ring_bytes

MEAN_OVER = 8  # a replica's mean step time is over its last this many clocks


class _Pending:
    """One clock's gradient exchange in flight: the flat summed gradient and the clock metadata beside it."""
    __slots__ = ("clock", "flat", "work", "meta", "meta_work")

    def __init__(self, clock, flat, work, meta, meta_work):
        self.clock, self.flat, self.work, self.meta, self.meta_work = clock, flat, work, meta, meta_work


def _done(work) -> bool:
    check = getattr(work, "is_completed", None)
    return True if check is None else bool(check())


class StaleSyncOptimizer(ReplicaOptimizer):
    """ssp / dssp across dp_replicate, driven like ReplicaOptimizer (sync_step instead of clip + step)."""

    def __init__(self, wrapped, dims, pcfg: ParallelConfig, tcfg: TrainConfig, start_step: int = 0):
        super().__init__(wrapped, dims, pcfg, tcfg, start_step)
        assert self.mode in ("ssp", "dssp"), f"StaleSyncOptimizer: ssp or dssp, got {self.mode}"
        self.pending: list[_Pending] = []
        self.applied: list[int] = []  # clocks whose update was applied at the last sync_step
        self._last_applied = start_step  # the newest clock whose update was applied (a resume sets it)
        self.now = time.time  # the clock dssp predicts waits against (a test scripts it)
        self.step_times: list[float] = []
        self.peer_meta = None  # (R, 2) float64: wall time at the last published clock, mean step time
        self.peer_clock = 0

    def load_state_items(self, read) -> None:
        self.wrapped.load_state_items(read)
        self._last_applied = self.wrapped.steps_taken  # a checkpoint holds every update up to its step

    def _mean_step_time(self) -> float:
        recent = self.step_times[-MEAN_OVER:]
        return sum(recent) / max(1, len(recent))

    # ---- one clock ----
    def sync_step(self, clock: int, lr_at: Callable[[int], float], grad_clip: float,
                  check: Callable[[float], None], compute_s: float = 0.0) -> tuple[float, float, dict]:
        """Exchange and update for clock (1-based, after reduce_grads); returns (grad norm of the last
        update applied, its lr, metrics). check(norm) raises before a non-finite update is applied."""
        self.stats = {"wait_s": 0.0, "replica_bytes": 0}
        self.step_times.append(compute_s)
        self.applied = []
        self._launch(clock)
        norm, lr = self._apply_due(clock, self.pcfg.staleness, lr_at, grad_clip, check)
        self.stats["clock_lag"] = clock - (self.applied[-1] if self.applied else self._last_applied)
        self.stats["clock_lead"] = self._lead(clock)
        self.stats["applied"] = list(self.applied)
        return norm, lr, self.stats

    def _launch(self, clock: int) -> None:
        device = group_device(self.group)  # nccl on GPUs: a CPU tensor there crashes the collective
        flat = flatten(self._grads(), device)
        work = all_reduce_async(flat, self.group)
        meta = torch.zeros(self.R, 2, dtype=torch.float64, device=device)
        meta[self.dims.dp_replicate_rank] = torch.tensor([time.time(), self._mean_step_time()],
                                                         dtype=torch.float64, device=device)
        meta_work = all_reduce_async(meta, self.group)
        self.pending.append(_Pending(clock, flat, work, meta, meta_work))
        self.stats["replica_bytes"] += ring_bytes(flat.numel() * flat.element_size(), self.R)

    def _apply_due(self, clock, s, lr_at, grad_clip, check) -> tuple[float, float]:
        """Apply every pending update of clock <= clock - s (waiting for it), and under dssp the ones up
        to clock - staleness_min that are done or soon done."""
        count = sum(p.clock <= clock - s for p in self.pending)
        if self.mode == "dssp":
            count = self._dssp_count(clock, count)
        norm, lr = 0.0, lr_at(clock)
        for _ in range(count):
            p = self.pending.pop(0)
            self._wait(p.work)
            p.meta_work.wait()
            self.peer_meta, self.peer_clock = p.meta, p.clock
            norm, lr = self._apply_summed(p.flat, p.clock, lr_at, grad_clip, check)
            self.applied.append(p.clock)
            self._last_applied = p.clock
        return norm, lr

    def _dssp_count(self, clock: int, must: int) -> int:
        """How many pending updates to apply now: those at or below the upper bound, plus, in order, those
        within the lower bound that are complete or predicted to complete within half a step; agreed by
        every rank of the replica (max), so its ranks stay in step."""
        lo = self.pcfg.staleness_min
        count = must
        mine = self._mean_step_time()
        for p in self.pending[must:]:
            if p.clock > clock - lo:
                break
            if not (_done(p.work) and _done(p.meta_work)) and self._predicted_wait(p.clock) > 0.5 * mine:
                break
            count += 1
        if self.dims.replica_group is not None:
            t = torch.tensor([float(count)], device=group_device(self.dims.replica_group))
            all_reduce_max_(t, self.dims.replica_group)
            count = int(t.item())
        return count

    def _predicted_wait(self, target_clock: int) -> float:
        """Seconds until the slowest replica reaches target_clock, from the newest published clocks."""
        if self.peer_meta is None:
            return float("inf")
        now = self.now()
        worst = 0.0
        for t_pub, t_step in self.peer_meta.tolist():
            t_step = max(t_step, 1e-6)
            reached = self.peer_clock + (now - t_pub) / t_step
            worst = max(worst, (target_clock - reached) * t_step)
        return worst

    def _lead(self, clock: int) -> float:
        """This replica's clock minus the slowest replica's estimated clock (from published clocks)."""
        if self.peer_meta is None:
            return 0.0
        now = self.now()
        est = [self.peer_clock + (now - t_pub) / max(t_step, 1e-6) for t_pub, t_step in self.peer_meta.tolist()]
        return round(clock - min(min(est), clock), 3)

    # ---- checkpoints ----
    @torch.no_grad()
    def drain(self, clock: int, lr_at: Callable[[int], float], grad_clip: float) -> None:
        """Before a checkpoint: apply every pending update (the replicas become identical; this changes
        the run)."""
        self.stats = {"wait_s": 0.0, "replica_bytes": 0}
        if self.pending:
            self._apply_due(clock, -(1 << 30), lr_at, grad_clip, lambda norm: None)
