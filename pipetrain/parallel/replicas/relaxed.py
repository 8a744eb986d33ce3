"""Relaxed synchronisation across data-parallel replicas (parallel.dp_sync; docs/relaxed_sync.md).

dp = dp_replicate x dp_shard (pipetrain.parallel.mesh.dims). Inside a replica everything stays bulk-synchronous:
the wrapped optimizer (pipetrain.optim.build.Optimizer or ZeRO over dp_shard) sums gradients over dp_shard and
runs clipping and its update with the replica's tp / pp / dp_shard peers. RelaxedOptimizer adds the
exchange between replicas, always between the ranks with the same (dp_shard, pp, tp) coordinate
(dims.dp_replicate_group), so every cross-replica message is one rank's (shard of its) tensors:

- bsp: the replica gradients are summed (blocking) before the update: the single-process gradient.
- ssp (staleness s): at clock c a rank starts an async all-reduce of its replica gradient of clock c,
  then waits for the all-reduces of every clock <= c - s and applies those summed gradients, oldest first,
  each with the learning rate of its own clock. Every replica applies the same updates at the same clocks,
  so replicas are bitwise identical and the trajectory does not depend on timing; a replica at clock c
  has applied every update of clocks <= c - s - 1 (indeed <= c - s) and, because the all-reduce of
  clock c - s needs every replica to have reached it, never runs more than s clocks ahead of the slowest.
  s = 0 is bsp: it takes bsp's path (sync_mode), so it is bsp bitwise.
- dssp (staleness_min .. staleness): as ssp with bound staleness, but at clock c the updates of clocks
  in (c - staleness, c - staleness_min] are applied too when they are complete, or when the predicted
  wait for them is short (under half this replica's mean step time). The prediction uses the clocks the
  replicas publish: every gradient all-reduce carries, beside it, a small float64 all-reduce of each
  replica's (wall time at that clock, mean step time); so publication costs no extra round trip and
  needs no TCPStore, at the price of being as stale as the newest completed exchange. The decision is
  agreed inside the replica (a max over the replica group), so its ranks apply the same updates.
  Replicas still apply the same updates in the same order; only when depends on timing.
- local_sgd (sync_every H, sync_warmup_steps W): W bsp steps, then every replica steps on its own
  gradient (scaled by dp_replicate: the loss is normalised by the global batch's tokens) and the
  parameters are averaged at every clock c with (c - W) % H == 0. With dp_shard inside a node and
  dp_replicate across nodes this is hierarchical local SGD.
- diloco (sync_every H, sync_warmup_steps W, outer_lr, outer_momentum): W bsp steps (DiLoCo starts from
  a synchronously trained model), then replicas take local inner steps and at the same clocks as
  local_sgd the pseudo-gradient (global params - local params) is averaged over replicas and outer
  Nesterov SGD updates the global params, which every replica copies. The global params and the outer
  momentum are kept beside the rank's (shard of the) parameters.

Under ZeRO the exchanged tensors are the rank's own gradient rows and parameter rows (shard-sized);
after averaging rows the replica all-gathers them over dp_shard as after any step.
Checkpoints call drain() first. ssp / dssp: the pending updates are applied (this changes the run:
docs/relaxed_sync.md says how). local_sgd / diloco: nothing changes; each replica saves its own
parameters and inner state under "replica<r>/" and the replicas' averages under the plain names
(what another layout, bsp, or an export loads), so a checkpoint never changes the trajectory.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from pipetrain.config import ParallelConfig, TrainConfig
from pipetrain.models.init import TIED_ALIASES
from pipetrain.optim.adamw import param_boxes
from pipetrain.parallel.mesh.comm import all_reduce_, all_reduce_async, all_reduce_max_, group_device
from pipetrain.parallel.data.grads import tied_copy_names
from pipetrain.parallel.replicas.wrapped import WrappedOptimizer
from pipetrain.parallel.data.zero import ZeroOptimizer

RELAXED_MODES = ("ssp", "dssp", "local_sgd", "diloco")
LOCAL_MODES = ("local_sgd", "diloco")  # replicas step on their own between syncs: per-replica checkpoint state


def sync_mode(pcfg: ParallelConfig) -> str:
    """The mode a run takes: ssp / dssp with staleness 0 wait for every replica's gradient before each
    update, which is bsp, so they take bsp's path (no clock metadata, no pending queue)."""
    if pcfg.dp_sync in ("ssp", "dssp") and pcfg.staleness == 0:
        return "bsp"
    return pcfg.dp_sync


def needs_relaxed(pcfg: ParallelConfig, dims, zero: int) -> bool:
    """Whether the optimizer must be wrapped: a relaxed mode, or bsp with ZeRO over dp_shard < dp."""
    if dims.dp_replicate == 1:
        return False
    return sync_mode(pcfg) != "bsp" or (zero >= 1 and dims.dp_shard > 1)


def replica_prefix(replica: int) -> str:
    """Checkpoint names of one replica's own state (local_sgd / diloco), e.g. "replica1/exp_avg/<name>"."""
    return f"replica{replica}/"


def ring_bytes(nbytes: int, n: int) -> int:
    """Bytes one rank sends in a ring all-reduce of nbytes over n ranks."""
    return 0 if n <= 1 else 2 * (n - 1) * nbytes // n


class _Pending:
    __slots__ = ("clock", "flat", "work", "meta", "meta_work")

    def __init__(self, clock, flat, work, meta, meta_work):
        self.clock, self.flat, self.work, self.meta, self.meta_work = clock, flat, work, meta, meta_work


def _done(work) -> bool:
    check = getattr(work, "is_completed", None)
    return True if check is None else bool(check())


class RelaxedOptimizer(WrappedOptimizer):
    """Wraps a replica's optimizer (Optimizer or ZeroOptimizer, reducing over dp_shard only) with the
    exchange across dp_replicate. The trainer calls zero_grad(); backward; reduce_grads(); then
    sync_step(clock, lr_at, grad_clip, check) instead of clip_grad_norm + step."""

    def __init__(self, inner, dims, pcfg: ParallelConfig, tcfg: TrainConfig, start_step: int = 0):
        self.inner, self.dims, self.pcfg, self.tcfg = inner, dims, pcfg, tcfg
        self.mode = sync_mode(pcfg)
        self.R = dims.dp_replicate
        self.group = dims.dp_replicate_group
        self.pending: list[_Pending] = []
        self.replica_scale = float(self.R)  # global batch / this replica's samples (the trainer sets it under DBS)
        self.applied: list[int] = []  # clocks whose update was applied at the last sync_step
        self._last_applied = start_step  # the newest clock whose update was applied (a resume sets it)
        self.now = time.time  # the clock dssp predicts waits against (a test scripts it)
        self._averages: dict | None = None  # local_sgd / diloco: what drain() computed for the checkpoint
        self.stats: dict = {}
        self.step_times: list[float] = []
        self.peer_meta = None  # (R, 2) float64: wall time at the last published clock, mean step time
        self.peer_clock = 0
        self.global_params: list[torch.Tensor] | None = None  # diloco
        self.outer_momentum: list[torch.Tensor] | None = None

    # ---- the wrapped optimizer's interface (the rest passes through: WrappedOptimizer) ----
    def state_items(self):
        """The inner optimizer's items; under local_sgd / diloco after drain(): the replicas' averages
        under the plain names, and this replica's own parameters and inner state under replica<r>/;
        diloco adds the global params and the outer momentum (the same on every replica). drain()
        prepares one checkpoint's averages and this hands them over (after checkpoint_params): they are
        dropped here so the copies do not stay in memory between checkpoints."""
        averages, self._averages = self._averages, None
        if averages is not None:
            prefix = replica_prefix(self.dims.dp_replicate_rank)
            items = list(averages["optim"])
            items += [(prefix + n, t, g, o) for n, t, g, o in self.inner.state_items()]
            if self.dims.dp_shard_rank == 0:  # the replica's parameters, once per replica (ZeRO gathered them)
                items += [(f"{prefix}param/{n}", p.detach(), g, o) for n, p, g, o in self._trainable_boxes()]
            count = torch.tensor(self.R, dtype=torch.int64, device="cpu")  # saved from the host, as "step" is
            items.append(("num_replicas", count, (), ()))
        else:
            items = self.inner.state_items()
        if self.global_params is not None:
            for (name, _, gshape, offsets), buf in zip(self._param_boxes(), self.global_params):
                items.append((f"global/{name}", buf, gshape, offsets))
        if self.outer_momentum is not None and self.pcfg.outer_momentum > 0:
            for (name, _, gshape, offsets), buf in zip(self._param_boxes(), self.outer_momentum):
                items.append((f"outer_momentum/{name}", buf, gshape, offsets))
        return items

    def checkpoint_params(self) -> dict:
        """{name: tensor} the checkpoint saves as model/<name> instead of this rank's parameter: the
        replicas' average under local_sgd / diloco (set by drain()); empty otherwise."""
        return {} if self._averages is None else self._averages["params"]

    def load_state_items(self, read) -> None:
        """Same replica count under local_sgd / diloco: this replica's own parameters and inner state
        (the run continues bitwise). Otherwise the plain names: the replicas' averages (the parameters
        came from model/, which holds the average)."""
        model = self.inner.model
        if self.mode in LOCAL_MODES and self._saved_replicas(read) == self.R:
            prefix = replica_prefix(self.dims.dp_replicate_rank)
            self.inner.load_state_items(lambda name, g, o, shape: read(prefix + name, g, o, shape))
            tied = tied_copy_names(model)
            with torch.no_grad():
                for name, p, g, o in self._trainable_boxes(include_tied_copy=True):
                    source = TIED_ALIASES.get(name, name) if name in tied else name
                    p.copy_(read(f"{prefix}param/{source}", g, o, tuple(p.shape)))
        else:
            self.inner.load_state_items(read)
        self._last_applied = self.inner.steps_taken  # a checkpoint holds every update up to its step
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

    def _trainable_boxes(self, include_tied_copy: bool = False):
        skip = set() if include_tied_copy else tied_copy_names(self.inner.model)
        return [e for e in param_boxes(self.inner.model) if e[1].requires_grad and e[0] not in skip]

    def state_bytes(self) -> int:
        extra = sum(t.numel() * t.element_size() for t in (self.global_params or []) + (self.outer_momentum or []))
        return self.inner.state_bytes() + extra

    # ---- what is exchanged ----
    def _is_zero(self) -> bool:
        return isinstance(self.inner, ZeroOptimizer)

    def _grads(self) -> list[torch.Tensor]:
        """This rank's gradient tensors the update reads (ZeRO: its rows; else every gradient)."""
        if self._is_zero():
            return [self.inner._grad_shards[i] for i in sorted(self.inner._grad_shards)]
        return [p.grad for p in self.inner.model.parameters() if p.grad is not None]

    def _params(self) -> list[torch.Tensor]:
        """This rank's parameter tensors the update writes (ZeRO: views of its rows)."""
        z = self.inner
        if self._is_zero():
            return [z._rows(z.params[i].detach(), i) for i in sorted(z.views)]
        return [p.detach() for p in z.model.parameters() if p.requires_grad]

    def _param_boxes(self):
        """(global name, tensor, global shape, offsets) of _params(), for checkpoints."""
        z = self.inner
        if self._is_zero():
            out = []
            for i in sorted(z.views):
                offsets, _ = z.shards[i].box(z.dp_rank)
                out.append((z.shards[i].name, z._rows(z.params[i].detach(), i), z.shards[i].global_shape, offsets))
            return out
        return [(n, p.detach(), g, o) for n, p, g, o in z._entries()]

    def _after_param_write(self) -> None:
        if self._is_zero():
            self.inner._all_gather_params()

    # ---- one clock ----
    def sync_step(self, clock: int, lr_at: Callable[[int], float], grad_clip: float,
                  check: Callable[[float], None], compute_s: float = 0.0) -> tuple[float, float, dict]:
        """Exchange and update for clock (1-based, after reduce_grads); returns (grad norm of the last
        update applied, its lr, metrics). check(norm) raises before a non-finite update is applied."""
        self.stats = {"wait_s": 0.0, "replica_bytes": 0}
        self.step_times.append(compute_s)
        self.applied = []
        if self.mode in ("bsp", "ssp", "dssp"):
            s = 0 if self.mode == "bsp" else self.pcfg.staleness
            self._launch(clock)
            norm, lr = self._apply_due(clock, s, lr_at, grad_clip, check)
            if self.mode != "bsp":
                self.stats["clock_lag"] = clock - (self.applied[-1] if self.applied else self._last_applied)
                self.stats["clock_lead"] = self._lead(clock)
                self.stats["applied"] = list(self.applied)
            return norm, lr, self.stats
        if clock <= self.pcfg.sync_warmup_steps:  # post-local SGD / DiLoCo: bulk-synchronous first
            self._launch(clock)
            norm, lr = self._apply_due(clock, 0, lr_at, grad_clip, check)
            return norm, lr, self.stats
        if self.mode == "diloco" and self.global_params is None:
            self.global_params = [t.clone() for t in self._params()]
        grads = self._grads()
        if self.R > 1:
            torch._foreach_mul_(grads, self.replica_scale)  # the replica's own mean gradient
        norm = self.inner.clip_grad_norm(grad_clip)
        check(norm)
        lr = lr_at(clock)
        self.inner.step(lr)
        if self.is_sync_clock(clock):
            self._average_params() if self.mode == "local_sgd" else self._outer_step()
        return norm, lr, self.stats

    def is_sync_clock(self, clock: int) -> bool:
        """local_sgd / diloco: whether replicas synchronise at the end of clock (fixed by the clock alone,
        so neither a checkpoint nor a resume moves it); warm-up clocks are bsp, synchronised too."""
        warm = self.pcfg.sync_warmup_steps
        return clock <= warm or (clock - warm) % self.pcfg.sync_every == 0

    def _launch(self, clock: int) -> None:
        grads = self._grads()
        device = group_device(self.group)  # nccl on GPUs: a CPU tensor there crashes the collective
        flat = torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(0, device=device)
        work = all_reduce_async(flat, self.group)
        meta = torch.zeros(self.R, 2, dtype=torch.float64, device=device)
        mean_t = sum(self.step_times[-8:]) / max(1, len(self.step_times[-8:]))
        meta[self.dims.dp_replicate_rank] = torch.tensor([time.time(), mean_t], dtype=torch.float64, device=device)
        meta_work = all_reduce_async(meta, self.group) if self.mode in ("ssp", "dssp") else None
        self.pending.append(_Pending(clock, flat, work, meta, meta_work))
        self.stats["replica_bytes"] += ring_bytes(flat.numel() * flat.element_size(), self.R)

    def _wait(self, work) -> None:
        t0 = time.perf_counter()
        work.wait()
        self.stats["wait_s"] += time.perf_counter() - t0

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
            if p.meta_work is not None:
                p.meta_work.wait()
                self.peer_meta, self.peer_clock = p.meta, p.clock
            offset = 0
            for g in self._grads():  # install the summed gradient of clock p.clock
                g.view(-1).copy_(p.flat[offset:offset + g.numel()])
                offset += g.numel()
            norm = self.inner.clip_grad_norm(grad_clip)
            check(norm)
            lr = lr_at(p.clock)
            self.inner.step(lr)
            self.applied.append(p.clock)
            self._last_applied = p.clock
        return norm, lr

    def _dssp_count(self, clock: int, must: int) -> int:
        """How many pending updates to apply now: those at or below the upper bound, plus, in order, those
        within the lower bound that are complete or predicted to complete within half a step; agreed by
        every rank of the replica (max), so its ranks stay in step."""
        lo = self.pcfg.staleness_min
        count = must
        mine = sum(self.step_times[-8:]) / max(1, len(self.step_times[-8:]))
        for p in self.pending[must:]:
            if p.clock > clock - lo:
                break
            if not (_done(p.work) and (p.meta_work is None or _done(p.meta_work))) \
                    and self._predicted_wait(p.clock) > 0.5 * mine:
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

    # ---- parameter averaging ----
    def _allreduce_mean(self, tensors: list[torch.Tensor]) -> None:
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        t0 = time.perf_counter()
        all_reduce_(flat, self.group)
        self.stats["wait_s"] += time.perf_counter() - t0
        self.stats["replica_bytes"] += ring_bytes(flat.numel() * flat.element_size(), self.R)
        flat.mul_(1.0 / self.R)
        offset = 0
        for t in tensors:
            t.view(-1).copy_(flat[offset:offset + t.numel()])
            offset += t.numel()

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
        """Before a checkpoint. ssp / dssp: apply every pending update (the replicas become identical;
        this changes the run). local_sgd / diloco: change nothing; average copies of the replicas'
        parameters (unless they are synchronised at this clock) and inner state for the plain names."""
        self.stats = {"wait_s": 0.0, "replica_bytes": 0}
        if self.pending:
            self._apply_due(clock, -(1 << 30), lr_at, grad_clip, lambda norm: None)
        self._averages = None
        if self.mode not in LOCAL_MODES:
            return
        params = {}
        if self.dims.dp_shard_rank == 0:  # model/ comes from dp rank 0; its replicate group is dp_shard rank 0's
            boxes = self._trainable_boxes()
            copies = [p.detach().clone() for _, p, _, _ in boxes]  # a file may not hold one tensor twice
            if not self.is_sync_clock(clock):  # on a sync clock the replicas hold the same parameters
                self._allreduce_mean(copies)
            params = {name: t for (name, _, _, _), t in zip(boxes, copies)}
        optim = [(n, t.clone() if t.dim() > 0 and t.is_floating_point() else t, g, o)
                 for n, t, g, o in self.inner.state_items()]
        self._allreduce_mean([t for _, t, _, _ in optim if t.dim() > 0 and t.is_floating_point()])
        self._averages = {"params": params, "optim": optim}
