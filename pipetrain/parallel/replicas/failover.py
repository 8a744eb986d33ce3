"""Replica failover with torchft (parallel.fault_tolerance: torchft; docs/fault_tolerance.md).

dp = dp_replicate x dp_shard (pipetrain.parallel.mesh.dims). Under torchft each dp_replicate coordinate is one
torchft *replica group* with its own torchrun: its world is dp_shard x pp x tp and its tp / pp / dp_shard
process groups are those of a standalone run of that size (ParallelDims, unchanged). The replica groups find
each other through a torchft lighthouse (env TORCHFT_LIGHTHOUSE); group g is told its index by the env
REPLICA_GROUP_ID=g (torchft's own examples use the same name); parallel.dp / dp_shard gives the number of
groups. Between groups everything goes through torchft's Manager, never through torch.distributed (a dead
group must not hang a collective of the others), between the ranks with the same (dp_shard, pp, tp)
coordinate in every live group. Per step:

    zero_grad     manager.start_quorum(): which groups are live; a group behind the live ones heals here,
                  before its forward, from a live peer over torchft's checkpoint transport: weights,
                  optimizer state, step and loader position (the state_dict callbacks below)
    backward      this group's slice of the global batch: the slice its dp_replicate coordinate reads
    reduce_grads  the sum inside the group (dp_shard, tp, tied embedding), as in any run
    sync_step     manager.allreduce(SUM) of the gradients and of (loss, target tokens); should_commit; step

The gradient. Each microbatch's loss is sum(CE) / (target tokens of the whole global batch), so the sum over
all groups is the single-process gradient (the layout rule). The sum over the live groups is scaled by
(global targets) / (live groups' targets): exactly 1 with every group live (the step is a plain bsp step),
and with groups missing the step takes the mean gradient over the samples that were seen: a smaller batch
at the same learning rate; the missing groups' samples of that step are skipped, not redone. The logged
loss is the mean over the live groups' target tokens; `ft_replicas` is the number of live groups.

A step whose exchange failed (a group died during it) is not committed by any group (should_commit) and is
redone with the same batch; metrics.jsonl gets one line for it, the redo's, with ft_redone (the attempts
that failed) and ft_redone_wait_s (the longest wait, quorum and exchange, of one of them). A fresh run (step 0, first attempt) waits until every group has joined, so a
group that starts early does not take steps alone; a restarted or resumed group never waits: it joins the
next quorum and heals.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Callable

import torch
from torch.distributed import ReduceOp, TCPStore

from pipetrain.config import ConfigError, ParallelConfig, Recipe
from pipetrain.faults import restart_count
from pipetrain.parallel.data.flat import copy_back_, flatten
from pipetrain.parallel.mesh.comm import broadcast_object_from_rank0
from pipetrain.parallel.mesh.rules import torchft_layout
from pipetrain.parallel.replicas.wrapped import WrappedOptimizer

REPLICA_ENV = "REPLICA_GROUP_ID"      # which replica group this torchrun is (0 .. groups - 1)
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # read by torchft itself: http://HOST:PORT of torchft_lighthouse
INSTALL = 'pip install "pipetrain[torchft]"'
# torchft's default for collectives, should_commit and healing transfers is 60 s; a dead peer closes its
# sockets at once, so the timeout only bounds a hung (not dead) peer. torchft's env TORCHFT_TIMEOUT_SEC wins.
TIMEOUT = timedelta(seconds=30)
JOIN_TIMEOUT_S = 600.0  # a fresh run waits this long for every replica group (data preparation included)
RETRY_S = 0.1           # between quorum requests while waiting: the lighthouse's default quorum tick


@dataclasses.dataclass(frozen=True)
class Replica:
    """This torchrun's place among the replica groups."""
    replica_id: int     # REPLICA_GROUP_ID: the dp_replicate coordinate, so the slice of the batch it reads
    num_replicas: int   # dp_replicate = parallel.dp / dp_shard
    dp_shard: int       # dp ranks inside the group = its world / (tp * pp)

    def local_parallel(self, p: ParallelConfig) -> ParallelConfig:
        """The group's own mesh: dp = dp_shard (one replica), everything else as the recipe says."""
        return dataclasses.replace(p, dp=self.dp_shard, dp_shard=self.dp_shard)

    def local_recipe(self, r: Recipe) -> Recipe:
        """The recipe as a standalone run of one group: its mesh and its share of the global batch. The layout
        checks run on it; the trainer keeps the full recipe (the loader reads the group's slice of it)."""
        train = dataclasses.replace(r.train, global_batch=r.train.global_batch // self.num_replicas)
        return dataclasses.replace(r, parallel=self.local_parallel(r.parallel), train=train)

    def output_dir(self, out: str) -> str:
        """Each group writes its own metrics, checkpoints and run lock."""
        return os.path.join(out, f"replica-{self.replica_id}")


def torchft_missing() -> str | None:
    """None when torchft imports, else the one-line reason and the install command."""
    # torchft's Rust side logs every quorum and commit at INFO (several lines per step); a user's RUST_LOG wins
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft  # noqa: F401  (optional extra: imported only to check that it is there)
    except ImportError as exc:
        return f"parallel.fault_tolerance=torchft: torchft is not installed ({exc}); {INSTALL}"
    return None


def replica_from_env(recipe: Recipe, world_size: int, env=os.environ) -> tuple[Replica | None, list[str]]:
    """This torchrun's replica group from the recipe (parallel.dp over all groups, tp, pp) and the environment
    (REPLICA_GROUP_ID, TORCHFT_LIGHTHOUSE), and every problem with them (then the Replica is None)."""
    missing = torchft_missing()
    if missing:
        return None, [missing]
    problems = []
    if not env.get(LIGHTHOUSE_ENV):
        problems.append(f"parallel.fault_tolerance=torchft: {LIGHTHOUSE_ENV} is not set; start "
                        "`torchft_lighthouse --min_replicas 1` and export "
                        f"{LIGHTHOUSE_ENV}=http://HOST:29510 for every replica group")
    dp, shard, layout = torchft_layout(recipe, world_size)
    problems += layout
    if not shard:
        return None, problems
    groups = max(1, dp // shard)
    raw = env.get(REPLICA_ENV)
    if raw is None:
        problems.append(f"parallel.fault_tolerance=torchft: {REPLICA_ENV} is not set; launch replica group g "
                        f"(0..{groups - 1}) with {REPLICA_ENV}=g")
    elif not (raw.isascii() and raw.isdigit()) or int(raw) >= groups:  # isdigit alone takes "\u00b2"
        problems.append(f"{REPLICA_ENV}: must be a replica group index in [0, {groups}) (parallel.dp={dp} / "
                        f"{shard} dp rank(s) per group), got {raw!r}")
    if problems:
        return None, problems
    return Replica(int(raw), groups, shard), []


def _replica_store(dims) -> tuple[TCPStore | None, str, int]:
    """A TCPStore on the group's rank 0 for torchft's Manager: a fresh one per torchrun attempt, because
    torchrun's agent store outlives a restart and would hand the previous attempt's manager address to the
    other ranks. Returns (the store on rank 0, else None; its host; its port)."""
    store, where = None, None
    if dims.rank == 0:
        host = socket.gethostname()  # what the other groups dial for the cross-group rendezvous, too
        store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        where = (host, store.port)
    host, port = broadcast_object_from_rank0(where, dims.world_size)
    return store, host, port


class FaultTolerantOptimizer(WrappedOptimizer):
    """Wraps a replica group's optimizer (pipetrain.optim.build.Optimizer, summing inside the group) with torchft's
    exchange between groups. The trainer calls zero_grad() (the step's quorum; may heal), backward,
    reduce_grads(), sets replica_loss, then sync_step(clock, lr_at, grad_clip, check) instead of
    clip_grad_norm + step. attach(trainer) must be called once the trainer exists (the healing state is
    the trainer's step and loader position as well as the weights and the optimizer state)."""

    def __init__(self, wrapped, dims, recipe: Recipe, replica: Replica):
        self.wrapped, self.dims, self.recipe, self.replica = wrapped, dims, recipe, replica
        self.replica_loss = 0.0  # this group's share of the step's loss (sum over its tokens / global tokens)
        self.trainer = None
        self.manager = None  # torchft's Manager, created at the first step (_join)
        self._store = None   # its TCPStore on the group's rank 0
        self._gate = False
        self._healed_at: int | None = None
        self._redone = 0      # failed attempts of the step being taken (reported with the one that commits)
        self._redone_wait_s = 0.0
        self._quorum_s = 0.0  # this step's wait for its quorum (healing included)

    @property
    def tag(self) -> str:
        return f"[replica {self.replica.replica_id} | rank {self.dims.rank}]"

    def attach(self, trainer) -> None:
        """Bind the trainer whose step and loader the healing state carries."""
        self.trainer = trainer
        self._gate = trainer.step == 0 and restart_count() == 0

    def _join(self) -> None:
        """Create the torchft manager, at the first step's quorum: from its first heartbeat until its first
        quorum request the lighthouse holds the live groups' quorum (a heartbeating group must join or die
        first, against split brain), so nothing may come between the two."""
        from torchft import Manager, ProcessGroupGloo  # optional extra: imported only under torchft

        self._store, host, port = _replica_store(self.dims)
        # Gloo between the groups on every device: torchft's ProcessGroupGloo registers itself for CUDA
        # tensors too (only the CPU path is tested here; ProcessGroupNCCL is the faster choice on GPUs).
        connect = self.recipe.parallel.ft_connect_timeout_s
        try:
            self.manager = self._manager(Manager, ProcessGroupGloo, host, port, connect)
        except RuntimeError as exc:
            if "failed to connect" not in str(exc):
                raise
            raise ConfigError(f"{self.tag} parallel.fault_tolerance=torchft: no torchft lighthouse answered at "
                              f"{os.environ.get(LIGHTHOUSE_ENV)!r} within parallel.ft_connect_timeout_s={connect:g}; "
                              f"start torchft_lighthouse there, or export {LIGHTHOUSE_ENV} with its address") from None
        # the manager counts steps from the trainer's: a group resumed from its checkpoint is behind by that much
        self.manager.load_state_dict({"step": self.trainer.step, "batches_committed": 0})

    def _manager(self, Manager, ProcessGroupGloo, host: str, port: int, connect_s: float):
        return Manager(
            pg=ProcessGroupGloo(timeout=TIMEOUT), load_state_dict=self._load_state_dict,
            state_dict=self._state_dict, min_replica_size=1,
            # synchronous quorum: a healing group loads the peer's state before its forward, so its own
            # gradient of that step counts (torchft's async quorum would zero it for the step)
            use_async_quorum=False,
            # every group initialises identically from train.seed, so step 0 needs no weight broadcast
            init_sync=False,
            timeout=TIMEOUT, connect_timeout=timedelta(seconds=connect_s), rank=self.dims.rank,
            world_size=self.dims.world_size, store_addr=host, store_port=port,
            replica_id=f"pipetrain_replica_{self.replica.replica_id}")

    def shutdown(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)

    # ---- the wrapped optimizer's interface (the rest passes through: WrappedOptimizer) ----
    def zero_grad(self) -> None:
        self.wrapped.zero_grad()
        self._quorum()

    # ---- one step ----
    def _quorum(self) -> None:
        """Start the step's quorum (healing this group if it is behind). A fresh run first waits for every
        group: each member of an incomplete quorum sees the same count and asks again, so no group steps
        alone and none is left inside an exchange the others abandoned."""
        t0 = time.perf_counter()
        if self.manager is None:
            self._join()
        m = self.manager
        m.start_quorum()
        self._quorum_s = time.perf_counter() - t0
        if not self._gate:
            return
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while m.num_participants() < self.replica.num_replicas:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.tag} torchft: {m.num_participants()} of {self.replica.num_replicas} "
                                   f"replica groups joined within {JOIN_TIMEOUT_S:.0f} s; start every group "
                                   f"({REPLICA_ENV}=0..{self.replica.num_replicas - 1}) against the same "
                                   f"lighthouse")
            time.sleep(RETRY_S)
            m.start_quorum()
        self._gate = False
        self._quorum_s = time.perf_counter() - t0

    def _targets(self) -> tuple[int, int]:
        """Target tokens of this step's whole global batch and of this group's slice of it."""
        loader = self.trainer.loader
        first = loader.samples - loader.global_batch  # loader.next() has served this step's batch
        shard = self.replica.dp_shard  # the group's dp ranks are consecutive: one run of the batch
        offset, size = loader.rank_slice(self.replica.replica_id * shard, shard)
        return loader.data.count_targets(first, loader.global_batch), loader.data.count_targets(first + offset, size)

    def sync_step(self, clock: int, lr_at: Callable[[int], float], grad_clip: float,
                  check: Callable[[float], None], compute_s: float = 0.0) -> tuple[float, float, dict]:
        """Sum gradients and (loss, targets) over the live groups, agree to commit, update. Returns (grad
        norm, lr, metrics: the global loss, ft_replicas, ft_quorum_s (the step's wait for its quorum),
        ft_wait_s (for the exchange and the commit), ft_healed_at / ft_committed / ft_redone when so). An
        uncommitted step's metrics (ft_committed False) are not logged: the trainer takes it again."""
        m = self.manager
        grads = [p.grad for p in self.trainer.model.parameters() if p.grad is not None]
        # torchft's gloo group takes CPU and CUDA tensors alike: each stays where it is used (no default device)
        flat = flatten(grads, self.dims.device)
        total, own = self._targets()
        stats = torch.tensor([self.replica_loss, float(own)], dtype=torch.float64, device="cpu")
        t0 = time.perf_counter()
        works = [m.allreduce(flat, reduce_op=ReduceOp.SUM), m.allreduce(stats, reduce_op=ReduceOp.SUM)]
        for work in works:
            work.wait()  # an error is recorded by the manager, and should_commit answers False
        live = m.num_participants()
        committed = m.should_commit()
        lr = lr_at(clock)
        # wall_time lines up the groups' timelines around a failure (benchmarks/failover.py reads it)
        extra = {"ft_replicas": live, "ft_quorum_s": self._quorum_s, "ft_wait_s": time.perf_counter() - t0,
                 "wall_time": time.time()}
        if self._healed_at is not None:
            extra["ft_healed_at"], self._healed_at = self._healed_at, None
        if not committed:
            self._redo(clock)
            self._redone_wait_s = max(self._redone_wait_s, self._quorum_s + extra["ft_wait_s"])
            extra["ft_committed"] = False
            extra["loss"] = self.replica_loss * total / max(own, 1)  # this group's own mean: nothing was summed
            return 0.0, lr, extra
        if self._redone:  # the failed attempts' lines are not logged: their count and longest wait go here
            extra.update(ft_redone=self._redone, ft_redone_wait_s=self._redone_wait_s)
            self._redone, self._redone_wait_s = 0, 0.0
        live_targets = float(stats[1])
        if live_targets != total:  # groups are missing: the mean gradient over the samples seen
            flat.mul_(total / live_targets)
        copy_back_(flat, grads)
        extra["loss"] = float(stats[0]) * total / live_targets
        norm = self.wrapped.clip_grad_norm(grad_clip)
        check(norm)
        self.wrapped.step(lr)
        return norm, lr, extra

    def _redo(self, clock: int) -> None:
        """A step no group committed is taken again with the same batch: the trainer's step counter and
        token count and the loader go back one step (the trainer adds them again as the step ends)."""
        t, loader = self.trainer, self.trainer.loader
        self._redone += 1
        t.step -= 1
        t.tokens_seen -= self.recipe.train.global_batch * self.recipe.train.seq_len
        loader.samples -= loader.global_batch
        print(f"{self.tag} torchft: step {clock} was not committed (a replica group failed during it); "
              "taking it again", file=sys.stderr, flush=True)

    # ---- healing: what a live group sends, what a group behind loads ----
    def _state_dict(self) -> dict:
        """Everything a group behind needs to continue as this one (called on torchft's quorum thread while
        this group's main thread waits in start_quorum, so nothing changes underneath)."""
        t = self.trainer
        return {"step": t.step, "samples": t.loader.samples,
                "model": dict(t.model.state_dict()),
                "optimizer": {name: tensor for name, tensor, _, _ in self.wrapped.state_items()}}

    def _load_state_dict(self, state: dict) -> None:
        """Become the live peer's copy: weights, optimizer state, step, loader position (called in
        start_quorum on the main thread, before this step's forward)."""
        t = self.trainer
        own = t.model.state_dict()
        with torch.no_grad():
            for name, tensor in state["model"].items():
                own[name].copy_(tensor)
        optimizer_state = state["optimizer"]
        self.wrapped.load_state_items(lambda name, global_shape, offsets, shape: optimizer_state[name])
        t.step = int(state["step"])
        t.loader.samples = int(state["samples"])
        t.tokens_seen = t.step * self.recipe.train.global_batch * self.recipe.train.seq_len
        self._healed_at = t.step
        if self.dims.rank == 0:
            print(f"{self.tag} torchft: healed from a live replica group at step {t.step} (weights, optimizer "
                  "state, data position); rejoining", flush=True)
