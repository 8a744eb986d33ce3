"""Exhaustive layout search: every (dp, tp, pp, cp, schedule, virtual_stages, split_backward, microbatches,
zero, recompute, sequence_parallel) the recipe leaves open, checked by candidate_problems (every parallel rule),
scored by the memory and cost models, ranked by predicted tokens/s.

The space (space()): tp, pp and cp range over the divisors of the world size (dp = world / (tp pp cp); cp only
where 2 cp divides seq_len, parallel/context/slicing.py's head and tail chunks); schedule over
schedules.SCHEDULES when pp > 1 (new schedules join by being listed there); virtual_stages over the divisors
of n_layers / pp, up to MAX_VIRTUAL, when pp > 1; split_backward over both values when pp > 1; microbatches over
the divisors of global_batch / dp (at most MICROBATCHES_PER_STAGE x pp when pp > 1: past that the bubble is
under 1/9 and every extra one costs a longer simulation); zero over 0, 1, 2, 3 when dp x cp > 1 (ZeRO shards
over both; 3 pays two parameter all-gathers per microbatch, so it ranks first only where nothing less sharded
fits); recompute over none, selective, full; sequence_parallel over both values when tp > 1. Keys the user fixed
(`fixed`, parallel key -> value) stay at their value. Candidates that candidate_problems or the schedule builder
refuse are rejected "does not divide"; those whose busiest rank exceeds the device memory "does not fit".
Ranking: tokens/s descending, then lower peak memory, then the layout tuple, so it is deterministic.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from pipetrain.config import ParallelConfig, Recipe
from pipetrain.parallel.mesh.rules import candidate_problems
from pipetrain.parallel.pipeline.schedules import SCHEDULES
from pipetrain.plan.cost import StepTime, step_time
from pipetrain.plan.devices import DeviceProfile
from pipetrain.plan.memory import RankMemory, rank_memory, run_memory
from pipetrain.plan.shapes import model_params

KEYS = ("dp", "tp", "pp", "cp", "schedule", "virtual_stages", "split_backward", "microbatches", "zero", "recompute",
        "sequence_parallel")
MAX_VIRTUAL = 4
MICROBATCHES_PER_STAGE = 8
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Plan:
    layout: dict                       # KEYS -> value
    memory: list[RankMemory]           # per pp rank, then per parameter server (memory.run_memory)
    time: StepTime

    @property
    def workers(self) -> list[RankMemory]:
        """The mesh's pp ranks: what the device must hold (servers keep their rows in host memory)."""
        return [r for r in self.memory if r.role == "worker"]

    @property
    def peak_bytes(self) -> int:
        return max(r.total for r in self.workers)

    def as_dict(self) -> dict:
        return {"layout": self.layout, "peak_bytes": self.peak_bytes, "memory": [r.as_dict() for r in self.memory],
                "time": self.time.as_dict()}


@dataclass
class SearchResult:
    world_size: int
    device: str
    plans: list[Plan]                                      # ranked, the ones that fit
    rejected: list[tuple[dict, str]] = field(default_factory=list)  # (layout, reason)

    def reasons(self) -> dict[str, int]:
        """Rejections counted by kind (the text before the first ':')."""
        out: dict[str, int] = {}
        for _, reason in self.rejected:
            kind = reason.split(":")[0]
            out[kind] = out.get(kind, 0) + 1
        return out


def _divisors(n: int) -> list[int]:
    """The divisors of n, ascending, in O(sqrt n) (a global batch of 1e9 took minutes counting to it)."""
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def world_problem(recipe: Recipe, world_size: int, memory_bytes: float) -> str:
    """Why no layout of world_size ranks can exist, found by arithmetic before any layout is scored ("" when
    none is found): more ranks than dp <= global_batch, tp <= n_heads and pp <= n_layers allow, or a model
    whose weights, gradients and AdamW state cannot fit even spread evenly over every rank."""
    m, t = recipe.model, recipe.train
    usable = t.global_batch * m.n_heads * m.n_layers * max(1, t.seq_len // 2)
    if world_size > usable:
        return (f"world size {world_size} exceeds the {usable:,} ranks this recipe can use (dp <= train.global_batch="
                f"{t.global_batch}, tp <= model.n_heads={m.n_heads}, pp <= model.n_layers={m.n_layers}, cp <= "
                f"train.seq_len/2={t.seq_len // 2}); plan for fewer processes or a larger batch")
    floor = state_floor(recipe, world_size)
    if floor > memory_bytes:
        return (f"model: {model_params(m):,} parameters need at least {floor / 2**30:,.1f} GiB per rank even spread "
                f"over all {world_size} ranks, but a device has {memory_bytes / 2**30:,.1f} GiB; shrink the model "
                "or plan for more devices")
    return ""


def state_floor(recipe: Recipe, world_size: int) -> float:
    """The fewest model-state bytes the busiest rank can hold: 4 weights + 4 gradients + 8 AdamW bytes per
    parameter, all spread evenly over every rank (no layout holds less); arithmetic on the parameter count."""
    return model_params(recipe.model) * 16 / world_size


def space(recipe: Recipe, world_size: int, fixed: dict | None = None) -> list[dict]:
    """Every candidate layout (KEYS -> value) of the search space, fixed keys held, in a fixed order."""
    fixed = fixed or {}
    m, t = recipe.model, recipe.train

    def options(key, values):
        return [fixed[key]] if key in fixed else list(values)

    out = []
    for tp, pp, cp in _meshes(world_size, t.seq_len, options):
        dp = world_size // (tp * pp * cp) if world_size % (tp * pp * cp) == 0 else 1
        for dp_value in options("dp", [dp]):
            multi = pp > 1
            schedules = options("schedule", SCHEDULES if multi else [ParallelConfig.schedule])
            per_rank = m.n_layers // pp if m.n_layers % pp == 0 else 1
            virtuals = [d for d in _divisors(per_rank) if d <= MAX_VIRTUAL] if multi else [1]
            batch = t.global_batch // dp_value if t.global_batch % dp_value == 0 else 1
            for schedule, v, split, mb, zero, rc, sp in itertools.product(
                    schedules, options("virtual_stages", virtuals),
                    options("split_backward", [False, True] if multi else [False]),
                    options("microbatches", [d for d in _divisors(batch)
                                             if not multi or d <= MICROBATCHES_PER_STAGE * pp]),
                    options("zero", [0, 1, 2, 3] if dp_value * cp > 1 else [0]),
                    options("recompute", RECOMPUTE),
                    options("sequence_parallel", [False, True] if tp > 1 else [False])):
                out.append({"dp": dp_value, "tp": tp, "pp": pp, "cp": cp, "schedule": schedule,
                            "virtual_stages": v, "split_backward": split, "microbatches": mb, "zero": zero,
                            "recompute": rc, "sequence_parallel": sp})
    return out


def _meshes(world_size: int, seq_len: int, options) -> list[tuple[int, int, int]]:
    """(tp, pp, cp) of the space: divisors of the world, cp only where seq_len splits into 2 cp chunks."""
    out = []
    for tp in options("tp", _divisors(world_size)):
        rest = world_size // tp if world_size % tp == 0 else 1
        for pp in options("pp", _divisors(rest)):
            cps = [c for c in _divisors(rest // pp if rest % pp == 0 else 1) if seq_len % (2 * c) == 0] or [1]
            out += [(tp, pp, cp) for cp in options("cp", cps)]
    return out


def apply_layout(recipe: Recipe, layout: dict) -> Recipe:
    """recipe with its parallel keys set to layout's."""
    return dataclasses.replace(recipe, parallel=dataclasses.replace(recipe.parallel, **layout))


def evaluate(recipe: Recipe, layout: dict, world_size: int, profile: DeviceProfile,
             ranks_per_node: int | None = None) -> Plan | str:
    """The Plan of one layout, or the reason it is rejected."""
    candidate = apply_layout(recipe, layout)
    problems = candidate_problems(candidate, world_size)
    if problems:
        return "does not divide: " + problems[0]
    try:
        memory = run_memory(candidate, world_size, staged_collectives=profile.staged_collectives,
                            device_type=profile.device_type)
    except (AssertionError, ValueError) as exc:  # the schedule builder refuses these sizes
        return f"schedule: {exc}"
    workers = [r for r in memory if r.role == "worker"]  # servers: host memory, which the profile does not give
    peak = max(r.total for r in workers)
    if peak > profile.memory_bytes:
        return f"does not fit: {peak / 2**30:.1f} GiB > {profile.memory_bytes / 2**30:.1f} GiB"
    busiest = max(workers, key=lambda r: r.params)
    return Plan(layout, memory, step_time(candidate, world_size, profile, ranks_per_node,
                                          (busiest.params, busiest.grads, busiest.optim)))


def _rank_key(plan: Plan):
    # 9 significant digits: layouts equal up to round-off tie, and the tie-breakers order them
    return (-float(f"{plan.time.tokens_per_s:.9g}"), plan.peak_bytes, tuple(str(plan.layout[k]) for k in KEYS))


def search(recipe: Recipe, world_size: int, profile: DeviceProfile, fixed: dict | None = None,
           ranks_per_node: int | None = None) -> SearchResult:
    """Every layout of space() evaluated; plans ranked, rejections with their reason."""
    result = SearchResult(world_size, profile.name, [])
    for layout in space(recipe, world_size, fixed):
        outcome = evaluate(recipe, layout, world_size, profile, ranks_per_node)
        if isinstance(outcome, Plan):
            result.plans.append(outcome)
        else:
            result.rejected.append((layout, outcome))
    result.plans.sort(key=_rank_key)
    return result


def _fits(candidate: Recipe, world_size: int, profile: DeviceProfile) -> bool:
    """Whether a layout runs and fits, with 1F1B's in-flight bound pp - rank instead of simulating."""
    p = candidate.parallel
    if candidate_problems(candidate, world_size):
        return False
    memory = rank_memory(candidate, world_size, in_flight=[min(p.pp - r, p.microbatches) for r in range(p.pp)],
                         staged_collectives=profile.staged_collectives, device_type=profile.device_type)
    return max(r.total for r in memory) <= profile.memory_bytes


def refused_by_rules(result, world_size: int, fixed: dict) -> str | None:
    """Why a search kept no layout when memory is not the reason (every layout broke a rule: a key that does not
    combine with another, a degree that does not divide the world), in one line; None when some layout was
    rejected for memory (nothing_fits says what would fit) or none was tried."""
    if not result.rejected or any(reason.startswith("does not fit") for _, reason in result.rejected):
        return None
    return (f"no layout of {world_size} processes keeps the fixed keys {fixed}: {result.rejected[0][1]}; drop a "
            "fixed parallel key or launch another world size")


def nothing_fits(recipe: Recipe, world_size: int, profile: DeviceProfile, fixed: dict | None = None,
                 max_world: int = 4096) -> str:
    """One line for when no layout fits: the smallest world size that would (at the leanest layout: ZeRO 2,
    full recompute, sequence parallel, one sequence per microbatch), or the key to change."""
    fixed = fixed or {}
    smallest = None
    for w in range(world_size + 1, max_world + 1):
        for tp in _divisors(w):
            for pp in _divisors(w // tp):
                layout = {"tp": tp, "pp": pp, "dp": w // (tp * pp), "schedule": "1f1b", "virtual_stages": 1,
                          "split_backward": False, "zero": 2 if w // (tp * pp) > 1 else 0, "recompute": "full",
                          "sequence_parallel": tp > 1}
                batch = recipe.train.global_batch // layout["dp"]
                if recipe.train.global_batch % layout["dp"]:
                    continue
                layout["microbatches"] = batch
                layout.update({k: v for k, v in fixed.items() if k not in ("dp", "tp", "pp")})
                if _fits(apply_layout(recipe, layout), w, profile):
                    smallest = (w, layout)
                    break
            if smallest:
                break
        if smallest:
            break
    seq = recipe.train.seq_len
    if smallest:
        w, layout = smallest
        return (f"no layout fits in {profile.memory_bytes / 2**30:.1f} GiB per rank on {world_size} ranks; the "
                f"smallest world size that fits is {w} (tp={layout['tp']} pp={layout['pp']} dp={layout['dp']}, "
                f"zero={layout['zero']}, recompute={layout['recompute']}), or lower train.seq_len={seq}")
    return (f"no layout fits in {profile.memory_bytes / 2**30:.1f} GiB per rank on up to {max_world} ranks; lower "
            f"train.seq_len={seq} or model.d_model / model.n_layers, or use a device with more memory")
