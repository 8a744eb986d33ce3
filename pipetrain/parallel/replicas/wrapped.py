"""Optimizer wrappers across data-parallel replicas: the pass-through base, and the bulk-synchronous
exchange the relaxed algorithms fall back to (parallel.dp_sync; docs/relaxed_sync.md).

dp = dp_replicate x dp_shard (pipetrain.parallel.mesh.dims). Inside a replica everything stays
bulk-synchronous: the wrapped optimizer (pipetrain.optim.build.Optimizer or ZeRO over dp_shard) sums
gradients over dp_shard and runs clipping and its update with the replica's tp / pp / dp_shard peers. The
wrappers add the exchange between replicas, always between the ranks with the same (dp_shard, pp, tp)
coordinate (dims.dp_replicate_group), so every cross-replica message is one rank's (shard of its) tensors;
under ZeRO these are its own gradient rows.

- WrappedOptimizer: the trainer's optimizer interface passed through to self.wrapped (failover.py's torchft
  wrapper subclasses it too).
- ReplicaOptimizer: bsp across replicas. The replica gradients are summed (blocking) before the update:
  the single-process gradient. parallel.dp_sync=bsp uses it when ZeRO shards over dp_shard < dp; the two
  relaxed algorithms subclass it and take this step where they are bulk-synchronous (ssp / dssp with
  staleness 0 are bsp: sync_mode; local_sgd / diloco during sync_warmup_steps):
    stale.py     StaleSyncOptimizer: ssp / dssp, stale gradients within a staleness bound
    periodic.py  PeriodicSyncOptimizer: local_sgd / diloco, local steps and periodic parameter averaging
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from pipetrain.config import ParallelConfig, TrainConfig
from pipetrain.parallel.data.flat import copy_back_, flatten
from pipetrain.parallel.data.zero import ZeroOptimizer
from pipetrain.parallel.mesh.comm import all_reduce_async, group_device


def sync_mode(pcfg: ParallelConfig) -> str:
    """The mode a run takes: ssp / dssp with staleness 0 wait for every replica's gradient before each
    update, which is bsp, so they take bsp's path (no clock metadata, no pending queue)."""
    if pcfg.dp_sync in ("ssp", "dssp") and pcfg.staleness == 0:
        return "bsp"
    return pcfg.dp_sync


def needs_replica_sync(pcfg: ParallelConfig, dims, zero: int) -> bool:
    """Whether the optimizer must be wrapped: a relaxed mode, or bsp with ZeRO over dp_shard < dp."""
    if dims.dp_replicate == 1:
        return False
    return sync_mode(pcfg) != "bsp" or (zero >= 1 and dims.dp_shard > 1)


def ring_bytes(nbytes: int, n: int) -> int:
    """Bytes one rank sends in a ring all-reduce of nbytes over n ranks."""
    return 0 if n <= 1 else 2 * (n - 1) * nbytes // n


class WrappedOptimizer:
    """zero_grad / reduce_grads / clip_grad_norm / step / state_items / load_state_items of self.wrapped,
    and any other attribute (stage, views, model, state_bytes, ...) read from it. Subclasses set
    self.wrapped in __init__."""

    steps_on_device = False  # a wrapper exchanges across replicas in sync_step: never the wrapped one's own path

    def __getattr__(self, name):
        if name == "wrapped":
            raise AttributeError(name)
        return getattr(self.wrapped, name)

    def zero_grad(self) -> None:
        self.wrapped.zero_grad()

    def reduce_grads(self) -> None:
        """Sum gradients inside the replica (dp_shard, tp, tied embedding)."""
        self.wrapped.reduce_grads()

    def clip_grad_norm(self, max_norm: float) -> float:
        return self.wrapped.clip_grad_norm(max_norm)

    def step(self, lr: float) -> None:
        self.wrapped.step(lr)

    def state_items(self):
        return self.wrapped.state_items()

    def load_state_items(self, read) -> None:
        self.wrapped.load_state_items(read)


class ReplicaOptimizer(WrappedOptimizer):
    """Wraps a replica's optimizer (Optimizer or ZeroOptimizer, reducing over dp_shard only) with the
    bulk-synchronous exchange across dp_replicate. The trainer calls zero_grad(); backward; reduce_grads();
    then sync_step(clock, lr_at, grad_clip, check) instead of clip_grad_norm + step."""

    def __init__(self, wrapped, dims, pcfg: ParallelConfig, tcfg: TrainConfig, start_step: int = 0):
        self.wrapped, self.dims, self.pcfg, self.tcfg = wrapped, dims, pcfg, tcfg
        self.mode = sync_mode(pcfg)
        self.R = dims.dp_replicate
        self.group = dims.dp_replicate_group
        self.stats: dict = {}  # this clock's wait_s and replica_bytes (and the subclasses' metrics)

    def _is_zero(self) -> bool:
        return isinstance(self.wrapped, ZeroOptimizer) or hasattr(self.wrapped, "parts")

    def _grads(self) -> list[torch.Tensor]:
        """This rank's gradient tensors the update reads (ZeRO: its rows, of each part under expert parallelism:
        parallel/expert/zero.py; else every gradient)."""
        if self._is_zero():
            parts = getattr(self.wrapped, "parts", (self.wrapped,))
            return [part._grad_shards[i] for part in parts for i in sorted(part._grad_shards)]
        return [p.grad for p in self.wrapped.model.parameters() if p.grad is not None]

    def _wait(self, work) -> None:
        t0 = time.perf_counter()
        work.wait()
        self.stats["wait_s"] += time.perf_counter() - t0

    def _apply_summed(self, flat: torch.Tensor, clock: int, lr_at: Callable[[int], float], grad_clip: float,
                      check: Callable[[float], None]) -> tuple[float, float]:
        """Install flat, the replicas' summed gradient of clock, into this rank's gradients; clip and update
        with clock's learning rate. check(norm) raises before a non-finite update is applied."""
        copy_back_(flat, self._grads())
        norm = self.wrapped.clip_grad_norm(grad_clip)
        check(norm)
        lr = lr_at(clock)
        self.wrapped.step(lr)
        return norm, lr

    def sync_step(self, clock: int, lr_at: Callable[[int], float], grad_clip: float,
                  check: Callable[[float], None], compute_s: float = 0.0) -> tuple[float, float, dict]:
        """Sum the replicas' gradients of clock (1-based, after reduce_grads) and update; returns (grad norm,
        lr, metrics)."""
        self.stats = {"wait_s": 0.0, "replica_bytes": 0}
        norm, lr = self._bsp_step(clock, lr_at, grad_clip, check)
        return norm, lr, self.stats

    def _bsp_step(self, clock: int, lr_at, grad_clip: float, check) -> tuple[float, float]:
        # nccl on GPUs: a CPU tensor there crashes the collective, so even an empty buffer goes on the group's device
        flat = flatten(self._grads(), group_device(self.group))
        self.stats["replica_bytes"] += ring_bytes(flat.numel() * flat.element_size(), self.R)
        self._wait(all_reduce_async(flat, self.group))
        return self._apply_summed(flat, clock, lr_at, grad_clip, check)
