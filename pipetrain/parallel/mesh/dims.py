"""ParallelDims: the dp x pp x cp x tp mesh of global ranks and its process groups.

Global ranks form a row-major mesh of shape (dp, pp, cp, tp): tp varies fastest, then cp, then pp, then dp,

    rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank,

so the ranks of one tp group are neighbours (one node, the fastest links), a cp group (context
parallelism: the K/V all-gather of every layer, the next-heaviest traffic) is tp ranks apart, and a pp
stage's peers are cp * tp ranks apart. With cp = 1 this is the (dp, pp, tp) mesh it always was. This
module is the ONLY creator of process groups (the device mesh and dist.new_group): everything else
receives `dims` and reads its groups.

The groups come from a torch.distributed DeviceMesh over that (dp, pp, cp, tp) grid with the dim names
"dp", "pp", "cp", "tp" (`dims.mesh`), the object DCP, FSDP2 and context parallelism take; splitting dp into
dp_replicate x dp_shard later is a reshape of the grid plus two names. The embedding group (first and
last pp stage, for tied embeddings) is no mesh dim: it is created with dist.new_group after the mesh,
in the same order on every rank, as torch.distributed requires even of the ranks that are not members.
The dp x cp group (`dp_cp_group`: gradients are summed over it, each cp rank holding the gradient of its
slice of the tokens) is created the same way when dp and cp are both > 1; it is dp_group when cp == 1 and
cp_group when dp == 1.

Group convention: a group attribute is None when its degree is 1 (or torch.distributed is not
initialised) and a real ProcessGroup otherwise. The collectives in pipetrain.parallel.mesh.comm treat None
as "a group of one: no communication", never as the default world group. Without a process group
(one process, no torchrun) there is no mesh either: `dims.mesh` is None and every group is None.

`mesh_rank_lists` computes the same groups with no processes, for tests and tools.

The dp axis splits further into dp_replicate x dp_shard (HSDP-style, dp_shard fastest: the shards of
one replica are neighbours), dp_rank = dp_replicate_rank * dp_shard + dp_shard_rank. ZeRO shards over
dp_shard (bulk-synchronous); the replica wrappers (pipetrain.parallel.replicas) act across
dp_replicate, between ranks with the same (dp_shard, pp, tp) coordinate. These groups, and the replica
group (every rank of one replica: its loss under a relaxed mode), are created with dist.new_group after
the mesh, like the embed groups. With dp_shard == dp (the default) dp_shard_group is dp_group and there
is no replicate group; with dp_shard == 1 dp_replicate_group is dp_group.

Expert parallelism (parallel.ep, pipetrain.parallel.expert) is carved out of dp: dp = expert_dp x ep with
ep fastest, so an ep group is ep consecutive dp ranks with the same (pp, cp, tp) coordinate (tokens
travel between them by all-to-all) and the expert-dp group is the dp ranks holding the same experts
(ep_rank = dp_rank % ep): expert gradients sum over it. Both are created with dist.new_group after the
mesh; with ep == dp the ep group is dp_group, with ep == 1 the expert-dp group is dp_group. Under context
parallelism an ep group stays inside one cp coordinate: each cp rank dispatches its own T/cp tokens over
its own ep group (the experts are token-local, so which rank computes a row never changes its result), and
the experts' replicas are then the expert-dp x cp ranks holding them (`expert_dp_cp_group`, expert-dp-major
like dp_cp_group): expert gradients sum over it, as the others do over dp x cp. It is expert_dp_group when
cp == 1, cp_group when ep == dp and dp_cp_group when ep == 1. Under HSDP (dp_replicate > 1) ep divides dp_shard,
so an ep group lies inside one replica and every replica holds the same experts at the same dp_shard rank:
ZeRO shards the expert rows over the replica's holders (`expert_dp_shard_group`, dp_shard / ep ranks) and the
replica wrapper sums them over dp_replicate, as it does the other rows.

Parameter servers (parallel.ps_servers = S, pipetrain.parallel.ps) are S extra ranks after the mesh:
global ranks world_size .. world_size + S - 1 (`full_world_size` in all). They are outside the mesh
(DeviceMesh gives them no coordinate) but make every group-creating call the workers make, in the same
order, as torch.distributed requires. Two more groups then exist: `workers_group` (the mesh's ranks:
the trainer's whole-world reductions, which servers do not join) and `ps_group`, a gloo group of the
servers and the first stage's tp rank 0 of every dp rank (the ranks that pull and push rows).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from pipetrain.config import ConfigError, ParallelConfig
from pipetrain.parallel.mesh.comm import set_workers_group
from pipetrain.parallel.mesh.rules import resolve_dp_shard

# Mesh dims, slowest-varying first; ranks are row-major over them.
MESH_DIM_NAMES = ("dp", "pp", "cp", "tp")


def mesh_rank_lists(mesh_shape: dict[str, int], axes: tuple[str, ...]) -> list[list[int]]:
    """Global ranks of every group spanning `axes` of a row-major mesh whose last axis varies fastest.

    mesh_rank_lists({"dp": 2, "pp": 1, "tp": 2}, ("tp",)) == [[0, 1], [2, 3]]; groups come out in
    ascending order of their smallest rank, ranks ascending within a group.
    """
    names = list(mesh_shape)
    unknown = [a for a in axes if a not in mesh_shape]
    assert not unknown, f"unknown mesh axes {unknown}; mesh has {names}"
    grid = torch.arange(_prod(mesh_shape.values()), device="cpu").reshape(*mesh_shape.values())
    moved = grid.movedim([names.index(a) for a in axes], list(range(-len(axes), 0)))
    group_size = _prod(mesh_shape[a] for a in axes)
    return moved.reshape(-1, group_size).tolist()


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available (local_cuda_index), else cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_cuda_index())
    return torch.device("cpu")


def local_cuda_index() -> int:
    """This process's GPU: its LOCAL_RANK (torchrun's rank on the node). ConfigError, marked with the rank so
    that this rank prints it (the CLI leaves other errors to rank 0, which has a GPU and waits), when the node
    runs more processes than this process sees GPUs."""
    index, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if index >= count:
        raise ConfigError(f"[rank {os.environ.get('RANK', '0')} | local rank {index}] LOCAL_RANK={index} needs CUDA "
                          f"device {index}, but this process sees {count} (CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); launch one process per GPU (torchrun "
                          f"--nproc-per-node={count}) with every GPU of the node visible to each")
    return index


@dataclass
class ParallelDims:
    """Degrees, this rank's coordinates, and the process groups of the dp x pp x cp x tp mesh.

    Construct it directly for rank arithmetic (no groups), or with `init` / `from_degrees`, which also
    build the device mesh and the groups when torch.distributed is initialised. The layout rules a user
    can break (degrees that do not fit the world) are checked before, in the CLI's layout check; here
    they are internal invariants and fail as assertions.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1                      # context parallelism: each cp rank holds a slice of every sequence
    rank: int = 0
    dp_shard: Optional[int] = None   # None = dp (one replica)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # The (dp, pp, cp, tp) DeviceMesh with MESH_DIM_NAMES; None without a process group.
    mesh: Optional[DeviceMesh] = field(default=None, repr=False, compare=False)
    dp_group: Optional[dist.ProcessGroup] = field(default=None, repr=False, compare=False)
    tp_group: Optional[dist.ProcessGroup] = field(default=None, repr=False, compare=False)
    pp_group: Optional[dist.ProcessGroup] = field(default=None, repr=False, compare=False)
    cp_group: Optional[dist.ProcessGroup] = field(default=None, repr=False, compare=False)
    # Every rank with this (pp, tp) coordinate: gradients sum over dp x cp (each cp rank holds a partial
    # gradient from its slice of the tokens). dp_group itself when cp == 1, cp_group when dp == 1.
    dp_cp_group: Optional[dist.ProcessGroup] = field(default=None, repr=False, compare=False)
    # First and last pp stage of this (dp, tp) coordinate: all-reduces the tied embedding's gradient.
    embed_group: Optional[dist.ProcessGroup] = field(default=None, repr=False, compare=False)
    dp_shard_group: Optional[dist.ProcessGroup] = field(default=None, repr=False, compare=False)
    dp_replicate_group: Optional[dist.ProcessGroup] = field(default=None, repr=False, compare=False)
    # Every rank of this replica (same dp_replicate coordinate); None when there is one replica.
    replica_group: Optional[dist.ProcessGroup] = field(default=None, repr=False, compare=False)
    ps_servers: int = 0              # extra server ranks after the mesh (parallel.ps_servers)
    workers_group: Optional[dist.ProcessGroup] = field(default=None, repr=False, compare=False)
    ps_group: Optional[dist.ProcessGroup] = field(default=None, repr=False, compare=False)
    ep: int = 1                      # expert parallelism inside dp (parallel.ep)
    ep_group: Optional[dist.ProcessGroup] = field(default=None, repr=False, compare=False)
    expert_dp_group: Optional[dist.ProcessGroup] = field(default=None, repr=False, compare=False)
    # Every rank holding this rank's experts under cp: expert-dp x cp (expert gradients sum over it)
    expert_dp_cp_group: Optional[dist.ProcessGroup] = field(default=None, repr=False, compare=False)
    # Under HSDP (dp_replicate > 1): the ranks of this replica holding this rank's experts (dp_shard / ep), which
    # ZeRO shards the expert rows over; None when that is one rank or there is one replica
    expert_dp_shard_group: Optional[dist.ProcessGroup] = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.dp_shard is None:
            self.dp_shard = self.dp
        assert isinstance(self.dp_shard, int) and self.dp_shard >= 1 and self.dp % self.dp_shard == 0, \
            f"dp_shard={self.dp_shard!r} must divide dp={self.dp}"
        assert isinstance(self.ep, int) and self.ep >= 1 and self.dp % self.ep == 0, \
            f"ep={self.ep!r} must divide dp={self.dp}"
        for name in MESH_DIM_NAMES:
            value = getattr(self, name)
            assert isinstance(value, int) and value >= 1, f"{name}={value!r} must be an integer >= 1"
        assert 0 <= self.rank < self.full_world_size, \
            f"rank {self.rank} is outside the mesh dp*pp*cp*tp={self.dp}*{self.pp}*{self.cp}*{self.tp}=" \
            f"{self.world_size} " \
            f"plus {self.ps_servers} server(s)"

    # ---- rank arithmetic (no communication) ----
    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def full_world_size(self) -> int:
        """Every process: the mesh plus the parameter servers."""
        return self.world_size + self.ps_servers

    @property
    def is_server(self) -> bool:
        return self.rank >= self.world_size

    @property
    def server_ranks(self) -> list[int]:
        return list(range(self.world_size, self.full_world_size))

    @property
    def ps_pushers(self) -> list[int]:
        """The ranks that talk to the servers: first pp stage, tp rank 0, one per dp rank."""
        return [self.global_rank(d, 0, 0) for d in range(self.dp)] if self.ps_servers else []

    @property
    def mesh_shape(self) -> dict[str, int]:
        """Axis sizes, slowest-varying first."""
        return {name: getattr(self, name) for name in MESH_DIM_NAMES}

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.tp) % self.cp

    @property
    def pp_rank(self) -> int:
        return (self.rank // (self.tp * self.cp)) % self.pp

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp * self.cp * self.pp)

    @property
    def dp_replicate(self) -> int:
        return self.dp // self.dp_shard

    @property
    def dp_shard_rank(self) -> int:
        return self.dp_rank % self.dp_shard

    @property
    def dp_replicate_rank(self) -> int:
        return self.dp_rank // self.dp_shard

    @property
    def zero_shard(self) -> int:
        """Ranks ZeRO shards model states over: dp_shard, times cp under context parallelism. Every cp rank
        holds the gradient of its own tokens, so the reduce-scatter that sums gradients over dp x cp (as
        the replicated optimizer's all-reduce does) can hand each of those ranks its own rows: one
        collective, and cp x smaller shards, rather than sharding over dp and all-reducing over cp too.
        Under cp, dp_shard is dp (rules.context_problems refuses a split), so the group is dp_cp_group."""
        return self.dp_shard * self.cp

    @property
    def zero_shard_rank(self) -> int:
        """This rank's index in the ZeRO shard group (dp_cp_group orders its ranks dp-major, then cp)."""
        return self.dp_shard_rank * self.cp + self.cp_rank

    @property
    def zero_shard_group(self) -> Optional[dist.ProcessGroup]:
        return self.dp_cp_group if self.cp > 1 else self.dp_shard_group

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.ep

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same experts: dp / ep."""
        return self.dp // self.ep

    @property
    def expert_dp_rank(self) -> int:
        return self.dp_rank // self.ep

    @property
    def expert_dp_shard(self) -> int:
        """Ranks of one replica holding the same experts: dp_shard / ep (expert_dp with one replica). An ep group
        lies inside one replica (rules: ep divides dp_shard), so replicas hold the same experts at the same
        dp_shard rank."""
        return self.dp_shard // self.ep

    @property
    def expert_zero_shard(self) -> tuple[int, int, Optional[dist.ProcessGroup]]:
        """(size, this rank's index, group) of the ranks holding this rank's experts, which ZeRO shards the
        expert rows over: expert-dp, times cp under context parallelism (as zero_shard is dp times cp); under
        HSDP those of this replica (expert_dp_shard, as zero_shard is dp_shard), the replica wrapper then
        summing each rank's rows over dp_replicate as it does the other rows (cp refuses a dp split)."""
        if self.dp_replicate > 1:
            assert self.dp_shard % self.ep == 0, f"{self.coords} ep={self.ep} must divide dp_shard={self.dp_shard}"
            return self.expert_dp_shard, self.dp_shard_rank // self.ep, self.expert_dp_shard_group
        return self.expert_dp * self.cp, self.expert_dp_rank * self.cp + self.cp_rank, self.expert_dp_cp_group

    @property
    def replica_size(self) -> int:
        """Ranks in one replica: dp_shard * pp * cp * tp."""
        return self.dp_shard * self.pp * self.cp * self.tp

    def global_rank(self, dp_rank: int, pp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        """The global rank at mesh coordinate (dp_rank, pp_rank, cp_rank, tp_rank)."""
        assert 0 <= dp_rank < self.dp and 0 <= pp_rank < self.pp and 0 <= tp_rank < self.tp \
            and 0 <= cp_rank < self.cp, \
            f"coordinate ({dp_rank}, {pp_rank}, {cp_rank}, {tp_rank}) is outside the mesh {self.mesh_shape}"
        return ((dp_rank * self.pp + pp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    @property
    def coords(self) -> str:
        """Prefix for rank messages, e.g. "[rank 3 | dp 0 tp 1 pp 1]"."""
        cp = f" cp {self.cp_rank}" if self.cp > 1 else ""
        return f"[rank {self.rank} | dp {self.dp_rank} tp {self.tp_rank} pp {self.pp_rank}{cp}]"

    def group_rank_lists(self) -> dict[str, list[list[int]]]:
        """Every group of the mesh by kind, in creation order: {"tp": [[0, 1], ...], "pp": ..., ...}.
        A kind whose degree is 1 has no groups (its attribute stays None)."""
        shape = self.mesh_shape
        out = {}
        for kind in ("tp", "cp", "pp", "dp"):
            out[kind] = mesh_rank_lists(shape, (kind,)) if shape[kind] > 1 else []
        out["dp_cp"] = mesh_rank_lists(shape, ("dp", "cp")) if self.dp > 1 and self.cp > 1 else []
        out["embed"] = ([[lists[0], lists[-1]] for lists in mesh_rank_lists(shape, ("pp",))]
                        if self.pp > 1 else [])
        split = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "pp": self.pp, "cp": self.cp,
                 "tp": self.tp}
        both = self.dp_shard > 1 and self.dp_replicate > 1  # otherwise one of them is the dp group itself
        out["dp_shard"] = mesh_rank_lists(split, ("dp_shard",)) if both else []
        out["dp_replicate"] = mesh_rank_lists(split, ("dp_replicate",)) if both else []
        out["replica"] = (mesh_rank_lists(split, ("dp_shard", "pp", "cp", "tp"))
                          if self.dp_replicate > 1 and self.replica_size > 1 else [])
        experts = {"expert_dp": self.expert_dp, "ep": self.ep, "pp": self.pp, "cp": self.cp, "tp": self.tp}
        both = self.ep > 1 and self.expert_dp > 1  # otherwise one of them is the dp group itself
        out["ep"] = mesh_rank_lists(experts, ("ep",)) if both else []
        out["expert_dp"] = mesh_rank_lists(experts, ("expert_dp",)) if both else []
        # under cp: otherwise it is the expert-dp group (cp == 1) or the cp group (expert-dp == 1)
        out["expert_dp_cp"] = (mesh_rank_lists(experts, ("expert_dp", "cp"))
                               if self.ep > 1 and self.expert_dp > 1 and self.cp > 1 else [])
        # HSDP: dp_rank = (replica * expert_dp_shard + expert shard) * ep + ep_rank
        hsdp = self.ep > 1 and self.dp_replicate > 1 and self.dp_shard % self.ep == 0 and self.expert_dp_shard > 1
        shards = {"dp_replicate": self.dp_replicate, "expert_dp_shard": self.expert_dp_shard, "ep": self.ep,
                  "pp": self.pp, "cp": self.cp, "tp": self.tp}
        out["expert_dp_shard"] = mesh_rank_lists(shards, ("expert_dp_shard",)) if hsdp else []
        return out

    # ---- construction with process groups ----
    @classmethod
    def init(cls, parallel_cfg: ParallelConfig, world_size: int | None = None) -> "ParallelDims":
        """Dims for a recipe's parallel section; dp defaults to world_size / (tp * pp * cp).

        The world size and rank come from torch.distributed when it is initialised (a `world_size`
        argument must then agree); otherwise this is a single process and the world size is 1.
        """
        dims = cls.from_degrees(dp=parallel_cfg.dp, tp=parallel_cfg.tp, pp=parallel_cfg.pp, cp=parallel_cfg.cp,
                                ep=parallel_cfg.ep, world_size=world_size,
                                dp_shard=lambda dp: resolve_dp_shard(parallel_cfg, dp),
                                ps_servers=parallel_cfg.ps_servers)
        return dims

    @classmethod
    def from_degrees(cls, *, dp: int | None = None, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                     world_size: int | None = None, dp_shard=None, ps_servers: int = 0) -> "ParallelDims":
        """Dims for explicit degrees (dp=None: world_size / (tp * pp * cp)), building the mesh and every group.
        dp_shard: an int, None (= dp) or a function of the resolved dp. ps_servers: ranks of the world
        after the mesh that serve the embedding (world_size counts them; the mesh does not)."""
        initialised = dist.is_available() and dist.is_initialized()
        actual = (dist.get_world_size() if initialised else 1) - ps_servers
        assert isinstance(tp, int) and tp >= 1 and isinstance(pp, int) and pp >= 1, f"tp={tp!r}, pp={pp!r}"
        assert world_size is None or world_size == actual + ps_servers, \
            f"world size {world_size} was requested but {actual} processes are running"
        assert isinstance(cp, int) and cp >= 1, f"cp={cp!r}"
        cp_name, cp_value = ("*cp", f"*{cp}") if cp > 1 else ("", "")
        assert actual % (tp * pp * cp) == 0, \
            f"world size {actual} is not divisible by tp*pp{cp_name}={tp}*{pp}{cp_value}"
        dp = actual // (tp * pp * cp) if dp is None else dp
        assert dp * tp * pp * cp == actual, \
            f"dp*tp*pp{cp_name}={dp}*{tp}*{pp}{cp_value} does not equal the world size {actual}"
        dp_shard = dp_shard(dp) if callable(dp_shard) else dp_shard
        dims = cls(dp=dp, tp=tp, pp=pp, cp=cp, rank=dist.get_rank() if initialised else 0, device=default_device(),
                   dp_shard=dp_shard, ps_servers=ps_servers, ep=ep)
        if dims.device.type == "cuda":
            torch.cuda.set_device(dims.device)  # before the mesh, so nccl binds this rank's device
        if initialised:
            dims._build_mesh()
        return dims

    def checkpoint_group(self):
        """A gloo group of every rank for the background checkpoint writer's agreement, created at its first
        use (every rank saves at the same step, so every rank makes this call at the same point); None
        with one process. Its own group keeps the writer's collectives out of the training groups' order."""
        if self.full_world_size == 1:
            return None
        if getattr(self, "_checkpoint_group", None) is None:
            self._checkpoint_group = dist.new_group(list(range(self.full_world_size)), backend="gloo")
        return self._checkpoint_group

    def _build_mesh(self) -> None:
        """Build the (dp, pp, cp, tp) device mesh and read this rank's groups from it, then create the embed
        groups; every rank makes the same calls in the same order. The backend is the default group's."""
        # row-major: tp fastest; on the CPU whatever the default device (DeviceMesh copies it to the CPU)
        grid = torch.arange(self.world_size, device="cpu").reshape(*self.mesh_shape.values())
        self.mesh = DeviceMesh(self.device.type, grid, mesh_dim_names=MESH_DIM_NAMES)
        if self.is_server:
            assert self.mesh.get_coordinate() is None, f"server rank {self.rank} sits inside the device mesh"
        else:
            assert self.mesh.get_coordinate() == (self.dp_rank, self.pp_rank, self.cp_rank, self.tp_rank), \
                f"{self.coords} sits at {self.mesh.get_coordinate()} of the device mesh"
        for name in MESH_DIM_NAMES:
            if getattr(self, name) > 1 and not self.is_server:  # degree 1 keeps None: comm's "group of one"
                setattr(self, f"{name}_group", self.mesh.get_group(name))
        for ranks in self.group_rank_lists()["embed"]:
            pg = dist.new_group(ranks)
            if self.rank in ranks:
                self.embed_group = pg
        lists = self.group_rank_lists()
        for kind in ("dp_shard", "dp_replicate", "replica", "dp_cp", "ep", "expert_dp", "expert_dp_cp",
                     "expert_dp_shard"):
            for ranks in lists[kind]:
                pg = dist.new_group(ranks)
                if self.rank in ranks:
                    setattr(self, f"{kind}_group", pg)
        if self.dp_shard == self.dp:
            self.dp_shard_group = self.dp_group
        elif self.dp_shard == 1:
            self.dp_replicate_group = self.dp_group
        if self.ep == self.dp:
            self.ep_group = self.dp_group
        elif self.ep == 1:
            self.expert_dp_group = self.dp_group
        if self.cp == 1:
            self.dp_cp_group = self.dp_group
        elif self.dp == 1:
            self.dp_cp_group = self.cp_group
        if self.cp == 1:
            self.expert_dp_cp_group = self.expert_dp_group
        elif self.expert_dp == 1:
            self.expert_dp_cp_group = self.cp_group
        elif self.ep == 1:
            self.expert_dp_cp_group = self.dp_cp_group
        set_workers_group(None)
        if self.ps_servers:
            workers = dist.new_group(list(range(self.world_size)))
            ps = dist.new_group(self.ps_pushers + self.server_ranks, backend="gloo")
            if not self.is_server:
                self.workers_group = workers
                set_workers_group(workers)
            if self.rank in self.ps_pushers or self.is_server:
                self.ps_group = ps
