"""Periodic synchronisation across data-parallel replicas: parallel.dp_sync local_sgd and diloco
(docs/relaxed_sync.md; the replica groups and the bsp exchange this builds on: wrapped.py).

- local_sgd (sync_every H, sync_warmup_steps W): W bsp steps, then every replica steps on its own
  gradient (scaled by dp_replicate: the loss is normalised by the global batch's tokens) and the
  parameters are averaged at every clock c with (c - W) % H == 0. With dp_shard inside a node and
  dp_replicate across nodes this is hierarchical local SGD.
- diloco (sync_every H, sync_warmup_steps W, outer_lr, outer_momentum): W bsp steps (DiLoCo starts from
  a synchronously trained model), then replicas take local inner steps and at the same clocks as
  local_sgd the pseudo-gradient (global params - local params) is averaged over replicas and outer
  Nesterov SGD updates the global params, which every replica copies. The global params and the outer
  momentum are kept beside the rank's (shard of the) parameters.

Under ZeRO the exchanged tensors are the rank's own parameter rows (shard-sized); after averaging rows
the replica all-gathers them over dp_shard as after any step.
Checkpoints call drain() first, which changes nothing: each replica saves its own parameters and
wrapped-optimizer state under "replica<r>/" and the replicas' averages under the plain names (what another
layout, bsp, or an export loads), so a checkpoint never changes the trajectory.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from pipetrain.config import ParallelConfig, TrainConfig
from pipetrain.models.init import TIED_ALIASES
from pipetrain.optim.adamw import param_boxes
from pipetrain.parallel.data.flat import reduce_flat_
from pipetrain.parallel.data.grads import tied_copy_names
from pipetrain.parallel.mesh.comm import all_reduce_
from pipetrain.parallel.replicas.wrapped import ReplicaOptimizer, ring_bytes


def replica_prefix(replica: int) -> str:
    """Checkpoint names of one replica's own state, e.g. "replica1/exp_avg/<name>"."""
    return f"replica{replica}/"


class PeriodicSyncOptimizer(ReplicaOptimizer):
    """local_sgd / diloco across dp_replicate, driven like ReplicaOptimizer (sync_step instead of clip + step)."""

    def __init__(self, wrapped, dims, pcfg: ParallelConfig, tcfg: TrainConfig, start_step: int = 0):
        super().__init__(wrapped, dims, pcfg, tcfg, start_step)
        assert self.mode in ("local_sgd", "diloco"), f"PeriodicSyncOptimizer: local_sgd or diloco, got {self.mode}"
        self.replica_scale = float(self.R)  # global batch / this replica's samples (the trainer sets it under DBS)
        self._averages: dict | None = None  # what drain() computed for the checkpoint
        self.global_params: list[torch.Tensor] | None = None  # diloco
        self.outer_momentum: list[torch.Tensor] | None = None

    # ---- what is exchanged ----
    def _params(self) -> list[torch.Tensor]:
        """This rank's parameter tensors the update writes (ZeRO: views of its rows)."""
        z = self.wrapped
        if self._is_zero():
            return [z._rows(z.params[i].detach(), i) for i in sorted(z.views)]
        return [p.detach() for p in z.model.parameters() if p.requires_grad]

    def _param_boxes(self):
        """(global name, tensor, global shape, offsets) of _params(), for checkpoints."""
        z = self.wrapped
        if self._is_zero():
            out = []
            for i in sorted(z.views):
                offsets, _ = z.shards[i].box(z.dp_rank)
                out.append((z.shards[i].name, z._rows(z.params[i].detach(), i), z.shards[i].global_shape, offsets))
            return out
        return [(n, p.detach(), g, o) for n, p, g, o in z._entries()]

    def _trainable_boxes(self, include_tied_copy: bool = False):
        skip = set() if include_tied_copy else tied_copy_names(self.wrapped.model)
        return [e for e in param_boxes(self.wrapped.model) if e[1].requires_grad and e[0] not in skip]

    def _after_param_write(self) -> None:
        if self._is_zero():
            self.wrapped._all_gather_params()

    # ---- one clock ----
    def sync_step(self, clock: int, lr_at: Callable[[int], float], grad_clip: float,
                  check: Callable[[float], None], compute_s: float = 0.0) -> tuple[float, float, dict]:
        """This replica's own update for clock (1-based, after reduce_grads), then the synchronisation on a
        sync clock; bsp during the warm-up. Returns (grad norm, lr, metrics)."""
        if clock <= self.pcfg.sync_warmup_steps:  # post-local SGD / DiLoCo: bulk-synchronous first
            return super().sync_step(clock, lr_at, grad_clip, check, compute_s)
        self.stats = {"wait_s": 0.0, "replica_bytes": 0}
        if self.mode == "diloco" and self.global_params is None:
            self.global_params = [t.clone() for t in self._params()]
        grads = self._grads()
        if self.R > 1:
            torch._foreach_mul_(grads, self.replica_scale)  # the replica's own mean gradient
        norm = self.wrapped.clip_grad_norm(grad_clip)
        check(norm)
        lr = lr_at(clock)
        self.wrapped.step(lr)
        if self.is_sync_clock(clock):
            self._average_params() if self.mode == "local_sgd" else self._outer_step()
        return norm, lr, self.stats

    def is_sync_clock(self, clock: int) -> bool:
        """Whether replicas synchronise at the end of clock (fixed by the clock alone, so neither a
        checkpoint nor a resume moves it); warm-up clocks are bsp, synchronised too."""
        warm = self.pcfg.sync_warmup_steps
        return clock <= warm or (clock - warm) % self.pcfg.sync_every == 0

    # ---- parameter averaging ----
    def _allreduce_mean(self, tensors: list[torch.Tensor]) -> None:
        """Replace tensors by their mean over the replicas (one flat all-reduce)."""
        if not tensors:
            return

        def timed_sum(flat: torch.Tensor) -> None:
            t0 = time.perf_counter()
            all_reduce_(flat, self.group)
            self.stats["wait_s"] += time.perf_counter() - t0
            self.stats["replica_bytes"] += ring_bytes(flat.numel() * flat.element_size(), self.R)
        reduce_flat_(tensors, timed_sum, scale=1.0 / self.R)

    @torch.no_grad()
    def _average_params(self) -> None:
        self._allreduce_mean(self._params())
        self._after_param_write()

    @torch.no_grad()
    def _outer_step(self) -> None:
        """DiLoCo: average the pseudo-gradient, outer Nesterov SGD on the global params, copy them back."""
        local = self._params()
        delta = torch._foreach_sub(self.global_params, local)
        self._allreduce_mean(delta)
        mu, lr = self.pcfg.outer_momentum, self.pcfg.outer_lr
        if mu > 0:
            if self.outer_momentum is None:
                self.outer_momentum = [torch.zeros_like(d) for d in delta]
            torch._foreach_mul_(self.outer_momentum, mu)
            torch._foreach_add_(self.outer_momentum, delta)
            update = torch._foreach_add(delta, self.outer_momentum, alpha=mu)  # Nesterov
        else:
            update = delta
        torch._foreach_add_(self.global_params, update, alpha=-lr)
        for t, g in zip(local, self.global_params):
            t.copy_(g)
        self._after_param_write()

    # ---- checkpoints ----
    @torch.no_grad()
    def drain(self, clock: int, lr_at: Callable[[int], float], grad_clip: float) -> None:
        """Before a checkpoint; changes nothing: average copies of the replicas' parameters (unless they are
        synchronised at this clock) and wrapped-optimizer state, for the plain names."""
        self.stats = {"wait_s": 0.0, "replica_bytes": 0}
        self._averages = None
        params = {}
        if self.dims.dp_shard_rank == 0:  # model/ comes from dp rank 0; its replicate group is dp_shard rank 0's
            boxes = self._trainable_boxes()
            copies = [p.detach().clone() for _, p, _, _ in boxes]  # a file may not hold one tensor twice
            if not self.is_sync_clock(clock):  # on a sync clock the replicas hold the same parameters
                self._allreduce_mean(copies)
            params = {name: t for (name, _, _, _), t in zip(boxes, copies)}
        optim = [(n, t.clone() if t.dim() > 0 and t.is_floating_point() else t, g, o)
                 for n, t, g, o in self.wrapped.state_items()]
        self._allreduce_mean([t for _, t, _, _ in optim if t.dim() > 0 and t.is_floating_point()])
        self._averages = {"params": params, "optim": optim}

    def checkpoint_params(self) -> dict:
        """{name: tensor} the checkpoint saves as model/<name> instead of this rank's parameter: the
        replicas' average (set by drain()); empty otherwise."""
        return {} if self._averages is None else self._averages["params"]

    def state_items(self):
        """The wrapped optimizer's items; after drain(): the replicas' averages under the plain names, and
        this replica's own parameters and wrapped state under replica<r>/; diloco adds the global params
        and the outer momentum (the same on every replica). drain() prepares one checkpoint's averages and
        this hands them over (after checkpoint_params): they are dropped here so the copies do not stay in
        memory between checkpoints."""
        averages, self._averages = self._averages, None
        if averages is not None:
            prefix = replica_prefix(self.dims.dp_replicate_rank)
            items = list(averages["optim"])
            items += [(prefix + n, t, g, o) for n, t, g, o in self.wrapped.state_items()]
            if self.dims.dp_shard_rank == 0:  # the replica's parameters, once per replica (ZeRO gathered them)
                items += [(f"{prefix}param/{n}", p.detach(), g, o) for n, p, g, o in self._trainable_boxes()]
            count = torch.tensor(self.R, dtype=torch.int64, device="cpu")  # saved from the host, as "step" is
            items.append(("num_replicas", count, (), ()))
        else:
            items = self.wrapped.state_items()
        if self.global_params is not None:
            for (name, _, gshape, offsets), buf in zip(self._param_boxes(), self.global_params):
                items.append((f"global/{name}", buf, gshape, offsets))
        if self.outer_momentum is not None and self.pcfg.outer_momentum > 0:
            for (name, _, gshape, offsets), buf in zip(self._param_boxes(), self.outer_momentum):
                items.append((f"outer_momentum/{name}", buf, gshape, offsets))
        return items

    def load_state_items(self, read) -> None:
        """Same replica count: this replica's own parameters and wrapped state (the run continues bitwise).
        Otherwise the plain names: the replicas' averages (the parameters came from model/, which holds the
        average). diloco: the global params and outer momentum where saved."""
        model = self.wrapped.model
        if self._saved_replicas(read) == self.R:
            prefix = replica_prefix(self.dims.dp_replicate_rank)
            self.wrapped.load_state_items(lambda name, g, o, shape: read(prefix + name, g, o, shape))
            tied = tied_copy_names(model)
            with torch.no_grad():
                for name, p, g, o in self._trainable_boxes(include_tied_copy=True):
                    source = TIED_ALIASES.get(name, name) if name in tied else name
                    p.copy_(read(f"{prefix}param/{source}", g, o, tuple(p.shape)))
        else:
            self.wrapped.load_state_items(read)
        if self.mode != "diloco":
            return
        tied = tied_copy_names(model)

        def boxes(kind):
            return [read(f"{kind}/{TIED_ALIASES.get(name, name) if name in tied else name}", gshape, offsets,
                         tuple(t.shape)).clone() for name, t, gshape, offsets in self._param_boxes()]
        try:  # saved once the DiLoCo phase began; else (warm-up, bsp) they start at the next inner step
            self.global_params = boxes("global")
        except ValueError:
            self.global_params = None
        try:
            self.outer_momentum = boxes("outer_momentum") if self.pcfg.outer_momentum > 0 else None
        except ValueError:  # a bsp (or momentum-free) checkpoint: start the momentum at zero
            self.outer_momentum = None

    @staticmethod
    def _saved_replicas(read) -> int:
        """dp_replicate of a local_sgd / diloco checkpoint with per-replica state; 0 for any other."""
        try:
            return int(read("num_replicas", (), (), ()))
        except ValueError:  # ConfigError: not in the manifest
            return 0

    def state_bytes(self) -> int:
        extra = sum(t.numel() * t.element_size() for t in (self.global_params or []) + (self.outer_momentum or []))
        return self.wrapped.state_bytes() + extra
