"""One check of a recipe's parallel layout: every reason it cannot run on a given number of processes.

layout_problems(recipe, world_size) is what the CLI calls before starting anything; it lists every
problem at once, one message each (`<where>: <what>, got <actual>; <fix>` or `key=value ...; fix`).
The layers that build the run (ParallelDims, apply_tensor_parallel, build_stage, the schedule builders)
assume a layout that passed this check and only assert it. The rules that need no world size and no
layout (a degree is >= 1, lr > 0, ...) stay in config.validate.

The schedule's own rules are pipetrain.parallel.pipeline.schedules.schedule_problems (written once, there); besides
that this module reads only the recipe's dataclasses and imports nothing else from the parallel code, so every
layer can call it without an import cycle.
"""
from __future__ import annotations

from pipetrain.config import ModelConfig, ParallelConfig, Recipe
from pipetrain.parallel.replicas.dbs import dbs_problems
from pipetrain.parallel.pipeline.schedules import schedule_problems


def layout_problems(recipe: Recipe, world_size: int) -> list[str]:
    """Every problem with running recipe's dp x tp x pp layout on world_size processes (empty when it runs).

    The recipe must have passed config.validate (load_recipe and build_recipe run it): degrees >= 1."""
    p = recipe.parallel
    assert min(p.tp, p.pp, p.microbatches, p.virtual_stages) >= 1 and world_size >= 1, \
        f"layout_problems: run config.validate first (tp={p.tp}, pp={p.pp}, microbatches={p.microbatches}, " \
        f"virtual_stages={p.virtual_stages}, world size {world_size})"
    return (mesh_problems(recipe, world_size)
            + tensor_parallel_problems(recipe.model, p.tp, recipe.train.seq_len, p.sequence_parallel)
            + pipeline_problems(recipe.model, p)
            + relaxed_problems(recipe, world_size))


def resolve_dp(recipe: Recipe, world_size: int) -> int:
    """parallel.dp, or world_size / (tp * pp) when the recipe leaves it out."""
    tp_pp = recipe.parallel.tp * recipe.parallel.pp
    return recipe.parallel.dp if recipe.parallel.dp is not None else max(1, world_size // tp_pp)


def mesh_problems(recipe: Recipe, world_size: int) -> list[str]:
    """The dp x tp x pp mesh must cover the world, and dp * microbatches must divide the global batch.
    world_size: the mesh's ranks (with parallel.ps_servers, the processes launched minus the servers)."""
    p, t = recipe.parallel, recipe.train
    tp_pp = p.tp * p.pp
    servers = p.ps_servers
    after = f" + {servers} server(s) (parallel.ps_servers)" if servers else ""
    if world_size % tp_pp:
        return [f"world size {world_size}{' without the servers' if servers else ''} is not divisible by "
                f"parallel.tp*parallel.pp={tp_pp}; launch a multiple of {tp_pp} processes{after}"]
    problems = []
    dp = resolve_dp(recipe, world_size)
    if dp * tp_pp != world_size:
        problems.append(f"parallel.dp*tp*pp={dp}*{p.tp}*{p.pp}={dp * tp_pp} does not equal the world size "
                        f"{world_size}{' without the servers' if servers else ''}; launch {dp * tp_pp + servers} "
                        f"processes ({dp * tp_pp} workers{after}) or drop parallel.dp")
    if t.global_batch % (dp * p.microbatches):
        problems.append(f"train.global_batch={t.global_batch} must be divisible by dp*microbatches="
                        f"{dp}*{p.microbatches}={dp * p.microbatches}")
    return problems


def resolve_dp_shard(pcfg: ParallelConfig, dp: int) -> int:
    """parallel.dp_shard, or its default: dp with zero >= 1 (one replica, ZeRO over all of dp, as before
    the split), else 1 (every dp rank its own replica)."""
    if pcfg.dp_shard is not None:
        return pcfg.dp_shard
    return dp if pcfg.zero >= 1 else 1


def relaxed_problems(recipe: Recipe, world_size: int) -> list[str]:
    """dp = dp_replicate x dp_shard must split; a relaxed parallel.dp_sync needs dp_replicate > 1; injected
    slow ranks must lie inside the world."""
    p, f = recipe.parallel, recipe.faults
    problems = []
    dp = resolve_dp(recipe, world_size)
    shard = resolve_dp_shard(p, dp)
    if shard < 1 or dp % shard:
        problems.append(f"parallel.dp_shard: must divide dp={dp}, got {shard}; use one of {_divisors(dp)}")
    elif p.dp_sync != "bsp" and dp // shard < 2:
        problems.append(f"parallel.dp_sync={p.dp_sync}: needs dp_replicate = dp/dp_shard >= 2, got "
                        f"{dp}/{shard}={dp // shard}; lower parallel.dp_shard, launch more ranks or use bsp")
    elif p.dynamic_batch:
        problems += dbs_problems(p.schedule, p.pp, p.virtual_stages, p.microbatches, dp // shard)
    bad = [r for r in f.slow_ranks if not 0 <= r < world_size]
    if bad:
        problems.append(f"faults.slow_ranks: ranks must lie in [0, {world_size}), got {bad}; "
                        f"list global ranks below the world size {world_size}")
    if f.kill_rank is not None and f.kill_rank >= world_size + p.ps_servers:  # a server may be killed too
        problems.append(f"faults.kill_rank: must be < the world size {world_size + p.ps_servers}, got {f.kill_rank}")
    return problems


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def tensor_parallel_problems(model_cfg: ModelConfig, tp: int, seq_len: int | None = None,
                             sequence_parallel: bool = False) -> list[str]:
    """Every reason this model cannot be split tp ways (empty when it can), one message each."""
    m = model_cfg
    problems = []
    if m.n_heads % tp:
        problems.append(f"parallel.tp: must divide model.n_heads={m.n_heads} (attention is split by heads), "
                        f"got {tp}; use one of {_divisors(m.n_heads)}")
    kv = m.kv_heads
    if kv % tp and tp % kv:
        problems.append(f"parallel.tp: must divide model.n_kv_heads={kv} (kv heads split) or be a multiple of "
                        f"it (kv heads replicated), got {tp}; use a divisor or a multiple of {kv}")
    if m.ffn % tp:
        problems.append(f"parallel.tp: must divide model.ffn_hidden={m.ffn} (the MLP is split by columns), "
                        f"got {tp}; set model.ffn_hidden to a multiple of {tp}")
    if m.vocab_size % tp:
        padded = -(-m.vocab_size // tp) * tp
        problems.append(f"parallel.tp: must divide model.vocab_size={m.vocab_size} (embedding and head are "
                        f"split by vocab rows), got {tp}; pad the vocabulary to {padded} or use one of "
                        f"{_divisors(m.vocab_size)}")
    if sequence_parallel and seq_len is not None and seq_len % tp:
        problems.append(f"train.seq_len: must be divisible by parallel.tp={tp} under sequence parallelism "
                        f"(activations are split along T), got {seq_len}; use a multiple of {tp}")
    return problems


def pipeline_problems(model_cfg: ModelConfig, pcfg: ParallelConfig) -> list[str]:
    """Stages, explicit stage sizes and the schedule: every reason the layers cannot be staged this way."""
    m, p = model_cfg, pcfg
    problems = []
    num_stages = p.pp * p.virtual_stages
    if num_stages > m.n_layers:
        problems.append(f"parallel.pp*virtual_stages={p.pp}*{p.virtual_stages}={num_stages} exceeds "
                        f"model.n_layers={m.n_layers}; each stage needs at least one layer")
    problems += schedule_problems(p.schedule, p.pp, p.microbatches, p.virtual_stages)
    if p.schedule == "interleaved-1f1b" and p.virtual_stages > 1 and p.stage_layers is None and m.n_layers % num_stages:
        problems.append(f"model.n_layers={m.n_layers} is not divisible by pp*virtual_stages={num_stages} "
                        "for interleaved-1f1b; change the layer count or give parallel.stage_layers")
    if p.stage_layers is not None:
        counts = list(p.stage_layers)
        if len(counts) != num_stages or any(not isinstance(c, int) or c < 1 for c in counts):
            problems.append(f"parallel.stage_layers={counts} must list {num_stages} positive layer counts "
                            f"(one per stage: pp*virtual_stages={p.pp}*{p.virtual_stages})")
        elif sum(counts) != m.n_layers:
            problems.append(f"parallel.stage_layers={counts} sums to {sum(counts)}, not model.n_layers="
                            f"{m.n_layers}; give {num_stages} positive counts summing to model.n_layers={m.n_layers}")
    return problems
