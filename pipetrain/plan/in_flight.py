"""How many microbatches' activations a pp rank holds at once under a schedule (plan/memory.py multiplies by it).

schedule_shape simulates the schedule's action lists (pipetrain.parallel.pipeline.schedules) once per shape and
caches the result: the makespan the step-time model scales (plan/cost.py) and each rank's peak of
(microbatch, chunk) units forwarded and not yet done with (their B, or their W under a split backward).
end_chunks_in_flight counts the same for the chunk holding the first and the one holding the last stage,
until its B: what the first stage's token ids and the last stage's loss keep (the logits, the fused loss's
gradients) live that long, and under interleaving, the V schedules or a split backward far fewer of them are
in flight than of all the rank's units.
"""
from __future__ import annotations

import functools
import warnings

from pipetrain.config import Recipe
from pipetrain.parallel.mesh.rules import count_rules, resolve_dp, resolve_dp_shard
from pipetrain.parallel.pipeline.schedules import (B, F, build_all_schedules, peak_in_flight, placement_of, simulate,
                                                   stage_of)
from pipetrain.parallel.pipeline.stage import stage_costs


def busiest_microbatches(recipe: Recipe, world_size: int) -> int:
    """Microbatches of the busiest rank's step: parallel.microbatches, or under parallel.dynamic_batch the
    largest share a replica can be given (all the replicas' microbatches but the minimum each other replica
    keeps: DynamicBatch's rules); the microbatch size does not change."""
    p = recipe.parallel
    if not p.dynamic_batch:
        return p.microbatches
    dp = resolve_dp(recipe, world_size)
    replicas = dp // resolve_dp_shard(p, dp)
    minimum = count_rules(p.schedule, p.pp, p.virtual_stages)[1]
    return replicas * p.microbatches - (replicas - 1) * minimum


def zbv_stage_costs(recipe: Recipe) -> tuple[float, ...] | None:
    """The stage costs a zbv run orders its computes by (build._training_schedule passes them to the builder), so
    the planner simulates the schedule the run executes; None for every other schedule (fixed orders)."""
    p = recipe.parallel
    return tuple(stage_costs(recipe.model, p, recipe.train.seq_len)) if p.schedule == "zbv" else None


def schedule_in_flight(recipe: Recipe, world_size: int) -> list[int]:
    """Most (microbatch, chunk) activations each pp rank holds at once under the recipe's schedule."""
    p = recipe.parallel
    if p.pp == 1:
        return [1]  # forward and backward of one microbatch at a time
    return list(schedule_shape(p.schedule, p.pp, busiest_microbatches(recipe, world_size), p.virtual_stages,
                               p.split_backward, 3.0 if p.recompute == "full" else 2.0, zbv_stage_costs(recipe))[1])


@functools.lru_cache(maxsize=4096)
def schedule_shape(schedule: str, pp: int, microbatches: int, virtual_stages: int, split_backward: bool,
                   backward_cost: float, costs: tuple[float, ...] | None = None) -> tuple[float, tuple[int, ...]]:
    """(makespan at F = 1, peak in-flight units per rank) of the schedule; cached: the search asks often.
    costs: zbv's stage costs (zbv_stage_costs)."""
    actions = _build(schedule, pp, microbatches, virtual_stages, split_backward, backward_cost, costs)
    result = simulate(actions, cost_f=1.0, cost_b=backward_cost, virtual_stages=virtual_stages,
                      placement=placement_of(schedule))
    return result.makespan, tuple(peak_in_flight(a) for a in actions)


def end_chunks_in_flight(recipe: Recipe, world_size: int) -> list[tuple[int, int]]:
    """(first stage's, last stage's) most microbatches forwarded and not yet backwarded (B) at once, per pp rank
    (0 where the rank does not hold that stage)."""
    p = recipe.parallel
    if p.pp == 1:
        return [(1, 1)]
    return list(_end_chunks(p.schedule, p.pp, busiest_microbatches(recipe, world_size), p.virtual_stages,
                            p.split_backward, 3.0 if p.recompute == "full" else 2.0, zbv_stage_costs(recipe)))


@functools.lru_cache(maxsize=4096)
def _end_chunks(schedule: str, pp: int, microbatches: int, virtual_stages: int, split_backward: bool,
                backward_cost: float, costs: tuple[float, ...] | None = None) -> tuple[tuple[int, int], ...]:
    actions = _build(schedule, pp, microbatches, virtual_stages, split_backward, backward_cost, costs)
    placement, last_stage = placement_of(schedule), pp * virtual_stages - 1
    out = []
    for rank, rank_actions in enumerate(actions):
        chunks = {stage_of(rank, c, pp, placement): c for c in range(virtual_stages)}
        out.append(tuple(_forwarded_peak(rank_actions, chunks[s]) if s in chunks else 0 for s in (0, last_stage)))
    return tuple(out)


def _forwarded_peak(actions, chunk: int) -> int:
    """Most microbatches of chunk forwarded (F) and not yet backwarded (B) at once in a rank's action list."""
    live = peak = 0
    for a in actions:
        if a.chunk == chunk and a.kind in (F, B):
            live += 1 if a.kind == F else -1
            peak = max(peak, live)
    return peak


def _build(schedule: str, pp: int, microbatches: int, virtual_stages: int, split_backward: bool,
           backward_cost: float, costs: tuple[float, ...] | None = None):
    with warnings.catch_warnings():  # 1f1b with microbatches < pp warns; the search scores it instead
        warnings.simplefilter("ignore")
        return build_all_schedules(schedule, pp, microbatches, virtual_stages, backward_cost=backward_cost,
                                   split_backward=split_backward, stage_costs=None if costs is None else list(costs))
