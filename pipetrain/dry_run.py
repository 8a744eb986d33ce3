"""train.py --dry-run: check a recipe and its layout and print what the run would be, without running it.

Validates the recipe and the layout for the world size (layout_problems), then prints the parameter count
(the model built on the meta device: no weights), the stage split, the schedule's timeline and bubble
(schedules.simulate at B = 2 F, 3 F under full recompute) and every pp rank's and parameter server's
predicted peak memory by kind: the pre-flight check's estimate (pipetrain.preflight.check_model_fits, the
planner's pipetrain.plan.memory.run_memory), so the three report the same bytes. Loads no data, starts no
processes.
"""
from __future__ import annotations

import warnings

from pipetrain.config import ConfigError, Recipe
from pipetrain.parallel.mesh.rules import layout_problems, resolve_dp
from pipetrain.parallel.pipeline.schedules import build_all_schedules, placement_of, simulate
from pipetrain.parallel.pipeline.schedules.timeline import render_timeline
from pipetrain.plan.cost import backward_ratio
from pipetrain.plan.in_flight import zbv_stage_costs
from pipetrain.plan.memory import RankMemory
from pipetrain.plan.shapes import rank_stages
from pipetrain.plan.shapes import model_params
from pipetrain.preflight import check_model_fits, device_memory

GIB = 2 ** 30


def dry_run_report(recipe: Recipe, world_size: int) -> str:
    """The dry run's text; ConfigError listing every layout problem."""
    return dry_run_details(recipe, world_size)[0]


def dry_run_details(recipe: Recipe, world_size: int) -> tuple[str, list[RankMemory]]:
    """(the dry run's text, the per-rank memory it prints); ConfigError listing every layout problem."""
    problems = layout_problems(recipe, world_size)
    if problems:
        raise ConfigError("; ".join(problems))
    memory = check_model_fits(recipe, world_size)  # before any per-layer work: a million layers answers at once
    p, t = recipe.parallel, recipe.train
    dp = resolve_dp(recipe, world_size)
    params = model_params(recipe.model)
    lines = [f"dry run: recipe and layout are valid for {world_size} process(es): dp={dp} tp={p.tp} pp={p.pp} "
             f"{f'cp={p.cp} ' if p.cp > 1 else ''}"
             f"schedule={p.schedule} virtual_stages={p.virtual_stages} microbatches={p.microbatches} "
             f"zero={p.zero} recompute={p.recompute} sequence_parallel={p.sequence_parallel}",
             f"model: {params / 1e6:.2f}M parameters; {t.global_batch} x {t.seq_len} = "
             f"{t.global_batch * t.seq_len:,} tokens per step, {t.global_batch // (dp * p.microbatches)} "
             "sequences per microbatch", "stages (global layer indices per pp rank):"]
    for r in range(p.pp):
        layers, first, last, copy = rank_stages(recipe, r)
        extras = ", ".join(x for x, on in (("embedding", first), ("head + loss", last), ("tied head copy", copy)) if on)
        lines.append(f"  pp rank {r}: layers {layers}" + (f" + {extras}" if extras else ""))
    if p.pp > 1:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # microbatches < pp: the bubble line says it
            costs = zbv_stage_costs(recipe)  # zbv orders its computes by them, as the run's builder does
            actions = build_all_schedules(p.schedule, p.pp, p.microbatches, p.virtual_stages,
                                          backward_cost=backward_ratio(recipe), split_backward=p.split_backward,
                                          stage_costs=None if costs is None else list(costs))
        sim = simulate(actions, cost_f=1.0, cost_b=backward_ratio(recipe), virtual_stages=p.virtual_stages,
                       placement=placement_of(p.schedule))
        lines += [f"schedule {p.schedule} (F = 1, B = {backward_ratio(recipe):g}): bubble {sim.bubble:.1%}",
                  render_timeline(sim)]
    lines.append("predicted peak memory per rank (GiB): params / grads / optimizer / activations / comm; peak "
                 "(parameters, optimizer state and the largest phase: forward, end of backward, optimizer step)")
    for m in memory:
        who = f"parameter server {m.pp_rank}" if m.role == "server" else f"pp rank {m.pp_rank}"
        extra = "".join(f", {label} {value / GIB:.3f}" for label, value in (
            ("replica state", m.replica_state), ("pending gradients", m.pending), ("pulled rows", m.ps_tables))
            if value)
        lines.append(f"  {who}: {m.params / GIB:.3f} / {m.grads / GIB:.3f} / {m.optim / GIB:.3f} / "
                     f"{m.activations / GIB:.3f} / {m.comm / GIB:.3f}{extra}; peak {m.total / GIB:.3f}")
    available, source = device_memory(world_size + p.ps_servers)
    peak = max(m.total for m in memory if m.role == "worker")
    verdict = "fits" if peak <= available else "may not fit (the pre-flight check refuses only beyond its margin)"
    lines.append(f"{verdict}: largest predicted peak {peak / GIB:.2f} GiB per rank against {available / GIB:.2f} GiB "
                 f"({source})")
    return "\n".join(lines), memory


def dry_run(recipe: Recipe, world_size: int, rank: int = 0) -> int:
    report = dry_run_report(recipe, world_size)
    if rank == 0:
        print(report, flush=True)
    return 0
