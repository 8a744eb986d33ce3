"""Every rule on the parallel keys, written once: what a recipe's layout must satisfy to run.

Two kinds, both listing every problem at once, one message each (`<where>: <what>, got <actual>; <fix>` or
`key=value ...; fix`):
- parallel_problems(recipe): the rules that need no world size (a degree is >= 1, staleness_min <= staleness,
  what parameter servers and torchft refuse to combine with). config sits below parallel and may not import
  this module, so code that runs a recipe hands it to config: `load_recipe(path, overrides,
  rules=parallel_problems)` (the CLI, `prepare`, the planner) and `validate(recipe, parallel_problems)` (build),
  and one ConfigError lists these problems with config's own.
- layout_problems(recipe, world_size): every reason the dp x tp x pp layout cannot run on world_size
  processes; what the CLI checks before starting anything. The layers that build the run (ParallelDims,
  apply_tensor_parallel, build_stage, the schedule builders, DynamicBatch) assume a layout that passed both
  and only assert it. Under torchft, torchft_layout checks one replica group's launch.

A schedule's own rules are pipetrain.parallel.pipeline.schedules.schedule_problems (written once, there, and
asserted by its builders); pipeline_problems calls them. Besides that this module reads only the recipe's
dataclasses, so every layer can call it without an import cycle.
"""
from __future__ import annotations

import math

from pipetrain.config import ModelConfig, ParallelConfig, Recipe, TrainConfig
from pipetrain.parallel.pipeline.schedules import schedule_problems

DEGREES = ("tp", "pp", "cp", "ep", "microbatches", "virtual_stages")  # parallel keys that count something: each >= 1


# ---- rules that need no world size (config.validate runs them at load) ---------------------------------
def parallel_problems(recipe: Recipe) -> list[str]:
    """Every problem with recipe's parallel keys that needs no world size (empty when consistent)."""
    p = recipe.parallel
    problems = [f"parallel.{name}={getattr(p, name)} must be >= 1" for name in DEGREES if getattr(p, name) < 1]
    if p.zero not in (0, 1, 2, 3):
        problems.append(f"parallel.zero={p.zero} is not offered; use 0, 1, 2 or 3")
    if p.dp is not None and p.dp < 1:
        problems.append(f"parallel.dp={p.dp} must be >= 1")
    if p.recompute_layers is not None and p.recompute_layers < 0:  # [:-1] would recompute all blocks but the last
        problems.append(f"parallel.recompute_layers={p.recompute_layers} must be >= 0 (the blocks of each stage "
                        "recomputed under parallel.recompute=full; unset for all of them)")
    if not 0 < p.ft_connect_timeout_s < float("inf"):
        problems.append(f"parallel.ft_connect_timeout_s={p.ft_connect_timeout_s} must be a positive number of "
                        "seconds (torchft's default is 60)")
    return (problems + _relaxed_key_problems(p) + _ps_problems(recipe) + _fault_tolerance_problems(p)
            + context_problems(recipe)
            + zero3_problems(recipe) + moe_problems(recipe) + expert_parallel_problems(recipe))


def expert_parallel_problems(r: Recipe) -> list[str]:
    """parallel.ep > 1 (pipetrain.parallel.expert): needs experts that split ep ways; what it does not
    combine with beyond moe_problems' refusals, one line each. ep dividing dp needs the world size:
    mesh_problems checks it."""
    p, m = r.parallel, r.model
    if p.ep <= 1:
        return []
    if m.num_experts <= 0:
        return [f"parallel.ep: shards experts, but model.num_experts=0 (a dense model), got {p.ep}; set "
                "parallel.ep=1 or pick an MoE family"]
    out = []
    if m.num_experts % p.ep:
        out.append(f"parallel.ep: must divide model.num_experts={m.num_experts} (each ep rank holds "
                   f"num_experts/ep experts), got {p.ep}; use one of {_divisors(m.num_experts)}")
    if p.dp_shard is not None and p.dp_shard % p.ep:
        out.append(f"parallel.dp_shard: must be a multiple of parallel.ep={p.ep} (an ep group, whose ranks trade "
                   f"tokens every layer, lies inside one replica), got {p.dp_shard}; set dp_shard to a multiple "
                   f"of {p.ep}")
    if p.dynamic_batch and p.dp_shard is None:  # dp_shard a multiple of ep: each ep group inside one replica
        out.append(f"parallel.dynamic_batch: with parallel.ep={p.ep} needs every ep group inside one replica (its "
                   "ranks must run the same microbatches to pair their all-to-alls, and the split moves them between "
                   f"replicas); set parallel.dp_shard to a multiple of {p.ep} or drop dynamic_batch")
    return out


def moe_problems(r: Recipe) -> list[str]:
    """model.num_experts > 0 (pipetrain.models.moe): the compositions not built for experts, one line each."""
    p, t = r.parallel, r.train
    if r.model.num_experts <= 0:
        return []
    refused = [
        (p.dp_sync != "bsp", f"parallel.dp_sync={p.dp_sync} (the balancing bias reduces counts over all of dp "
         "every step)", "use parallel.dp_sync=bsp"),
        (p.fault_tolerance != "none", f"parallel.fault_tolerance={p.fault_tolerance}", "set it to none"),
        (p.ps_servers > 0 if isinstance(p.ps_servers, int) else False, "parallel.ps_servers",
         "set parallel.ps_servers=0"),
    ]
    return _moe_refusals(r, refused)


def _moe_refusals(r: Recipe, refused: list) -> list[str]:
    return [f"{key}: does not combine with model.num_experts={r.model.num_experts} yet; {fix}"
            for on, key, fix in refused if on]


def zero3_problems(r: Recipe) -> list[str]:
    """parallel.zero=3 (pipetrain.parallel.data.zero3): the compositions it does not support yet, one line each."""
    p = r.parallel
    if p.zero != 3:  # its one key of its own would be ignored
        return [] if p.reshard_after_forward else [
            "parallel.reshard_after_forward=false: applies to parallel.zero=3 only (its gathered weights kept for "
            f"backward), got parallel.zero={p.zero}; set parallel.zero=3 or drop it"]
    why = "parallel.zero=3"
    refused = [
        (p.dp_sync != "bsp", f"parallel.dp_sync={p.dp_sync}", "use parallel.dp_sync=bsp or parallel.zero=2"),
        (p.ps_servers > 0 if isinstance(p.ps_servers, int) else False, "parallel.ps_servers",
         "set parallel.ps_servers=0"),
    ]  # fault_tolerance=torchft refuses every zero stage (_fault_tolerance_problems)
    return [f"{key}: does not combine with {why} yet; {fix}" for on, key, fix in refused if on]


def _relaxed_key_problems(p: ParallelConfig) -> list[str]:
    """Relaxed synchronisation and dynamic batching (pipetrain.parallel.replicas); the layout ones,
    dp_replicate > 1, are relaxed_problems'."""
    out = []

    def need(cond: bool, msg: str):
        if not cond:
            out.append(msg)

    if p.dp_shard is not None:
        need(p.dp_shard >= 1, f"parallel.dp_shard: must be >= 1, got {p.dp_shard}; drop it for the default")
    need(p.staleness >= 0, f"parallel.staleness: must be >= 0, got {p.staleness}; use 0 (bsp) or more")
    need(p.staleness_min >= 0, f"parallel.staleness_min: must be >= 0, got {p.staleness_min}; use 0 or more")
    if p.dp_sync == "dssp":
        need(p.staleness_min <= p.staleness, f"parallel.staleness_min: must be <= parallel.staleness="
             f"{p.staleness}, got {p.staleness_min}; lower staleness_min or raise staleness")
    need(p.sync_every >= 1, f"parallel.sync_every: must be >= 1, got {p.sync_every}; use 1 or more steps")
    need(p.dynamic_batch_every >= 1, f"parallel.dynamic_batch_every: must be >= 1, got {p.dynamic_batch_every}; "
         "use 5 (a median over 5 steps ignores one slow step)")
    need(p.sync_warmup_steps >= 0, f"parallel.sync_warmup_steps: must be >= 0, got {p.sync_warmup_steps}")
    need(p.outer_lr > 0, f"parallel.outer_lr: must be > 0, got {p.outer_lr}; DiLoCo uses about 0.7")
    need(0 <= p.outer_momentum < 1, f"parallel.outer_momentum: must be in [0, 1), got {p.outer_momentum}; "
         "DiLoCo uses 0.9")
    return out


def _ps_problems(r: Recipe) -> list[str]:
    """parallel.ps_servers / ps_sync (pipetrain.parallel.ps): what a parameter server cannot serve."""
    p, m = r.parallel, r.model
    if not (isinstance(p.ps_servers, int) and not isinstance(p.ps_servers, bool) and p.ps_servers >= 0):
        return [f"parallel.ps_servers: must be an integer >= 0, got {p.ps_servers!r}; 0 turns servers off"]
    if p.ps_servers == 0:
        return [] if p.ps_sync == "bsp" else [f"parallel.ps_sync={p.ps_sync} needs parameter servers; set "
                                               "parallel.ps_servers >= 1 or drop parallel.ps_sync"]
    out = []
    if m.tied:
        out.append(f"parallel.ps_servers: needs an untied input embedding, but model.family={m.family} ties it to "
                   "the LM head (which reads every row every step); set model.tie_embeddings=false or drop "
                   "parallel.ps_servers")
    if p.ps_sync == "ssp" and p.staleness < 1:
        out.append("parallel.ps_sync=ssp needs parallel.staleness >= 1 (the versions a pulled row may lag); set "
                   "parallel.staleness, or use ps_sync=bsp (staleness 0)")
    others = [(p.dp_sync != "bsp", f"parallel.dp_sync={p.dp_sync}"), (p.dynamic_batch, "parallel.dynamic_batch"),
              (m.lora_rank is not None, "model.lora_rank"), (bool(m.init_from), "model.init_from")]
    # fault_tolerance=torchft with servers: _fault_tolerance_problems says why
    for on, key in others:
        if on:
            out.append(f"parallel.ps_servers does not combine with {key}; drop one of them (servers keep the "
                       "dense part bulk-synchronous and train the table from the seed or a checkpoint)")
    return out


def _fault_tolerance_problems(p: ParallelConfig) -> list[str]:
    """parallel.fault_tolerance=torchft: the combinations that cannot work with torchft's per-step averaging
    over the live replica groups (the launch environment is checked by pipetrain.parallel.replicas.failover)."""
    if p.fault_tolerance != "torchft":
        return []
    why = "parallel.fault_tolerance=torchft"
    out = []
    if p.dp is None:
        out.append(f"parallel.dp: must be given under {why} (replica groups x dp ranks per group), got none; "
                   "e.g. parallel.dp=2 for two replica groups of one dp rank each")
    if p.dp_sync != "bsp":
        out.append(f"parallel.dp_sync={p.dp_sync}: does not combine with {why} (torchft averages every step's "
                   "gradients over the live replica groups); use parallel.dp_sync=bsp or fault_tolerance=none")
    if p.ps_servers:
        out.append(f"parallel.ps_servers={p.ps_servers}: does not combine with {why} (the servers would be a "
                   "single point of failure outside every replica group); set parallel.ps_servers=0")
    if p.dynamic_batch:
        out.append(f"parallel.dynamic_batch: does not combine with {why} (each replica group reads a fixed "
                   "slice of the global batch); set parallel.dynamic_batch=false")
    if p.zero:
        out.append(f"parallel.zero={p.zero}: is not implemented under {why} (replica groups exchange whole "
                   "gradients); set parallel.zero=0")
    return out


def context_problems(recipe: Recipe) -> list[str]:
    """parallel.cp (pipetrain.parallel.context): the sequence must split into 2*cp equal chunks (a head and a
    tail chunk per rank), and the compositions not built with cp yet are refused rather than run wrong."""
    p, t = recipe.parallel, recipe.train
    if p.cp <= 1:
        return []
    why = f"parallel.cp={p.cp}"
    if t.seq_len % (2 * p.cp):
        return [f"train.seq_len: must be divisible by 2*parallel.cp={2 * p.cp} (each cp rank takes one head and "
                f"one tail chunk of every sequence), got {t.seq_len}; use a multiple of {2 * p.cp}"]
    out = []
    if p.sequence_parallel and p.tp > 1 and (t.seq_len // p.cp) % p.tp:
        out.append(f"train.seq_len: its cp slice seq_len/cp={t.seq_len // p.cp} must be divisible by "
                   f"parallel.tp={p.tp} under sequence_parallel, got {t.seq_len}; use a multiple of {2 * p.cp * p.tp}")
    refused = [  # (in use, key=value, why not yet)
        (p.dp_shard is not None and p.zero >= 1, f"parallel.dp_shard={p.dp_shard}",
         "ZeRO shards over all of dp x cp under cp (no replicas of the shards); drop parallel.dp_shard"),
        (p.dp_sync != "bsp", f"parallel.dp_sync={p.dp_sync}", "relaxed replicas are not built with cp; use bsp"),
        (p.dynamic_batch, "parallel.dynamic_batch", "the dynamic split is not built with cp; drop it"),
        (p.ps_servers > 0, f"parallel.ps_servers={p.ps_servers}", "parameter servers are not built with cp; set 0"),
        (p.fault_tolerance != "none", f"parallel.fault_tolerance={p.fault_tolerance}",
         "torchft replica groups are not built with cp; set fault_tolerance=none"),
    ]
    out += [f"{key}: does not combine with {why} yet ({fix})" for used, key, fix in refused if used]
    return out


# ---- rules against the world size (the CLI checks them before starting anything) -------------------
def layout_problems(recipe: Recipe, world_size: int) -> list[str]:
    """Every problem with running recipe's dp x cp x tp x pp layout on world_size processes (empty when it runs).

    The recipe must have passed parallel_problems (load_recipe runs it when handed it): degrees >= 1."""
    p = recipe.parallel
    assert min(p.tp, p.pp, p.microbatches, p.virtual_stages) >= 1 and world_size >= 1, \
        f"layout_problems: run parallel_problems first (tp={p.tp}, pp={p.pp}, microbatches={p.microbatches}, " \
        f"virtual_stages={p.virtual_stages}, world size {world_size})"
    return (mesh_problems(recipe, world_size)
            + tensor_parallel_problems(recipe.model, p.tp, recipe.train.seq_len, p.sequence_parallel)
            + pipeline_problems(recipe.model, p)
            + relaxed_problems(recipe, world_size)
            + fp8_layout_problems(recipe))


def candidate_problems(recipe: Recipe, world_size: int) -> list[str]:
    """Every rule a layout the planner proposes must pass: the parallel keys' own (parallel_problems: the
    compositions refused, such as ZeRO under torchft or zero 3 with parameter servers) and the world size's
    (layout_problems), as a recipe that set those keys by hand is checked. Degrees must be >= 1."""
    return parallel_problems(recipe) + layout_problems(recipe, world_size)


def fp8_layout_problems(recipe: Recipe) -> list[str]:
    """fp8 scales must come from the full tensor: replicated kv heads (n_kv_heads < tp) have tp-partial
    gradients, so their amax over tp would not be tp=1's."""
    tp, kv = recipe.parallel.tp, recipe.model.kv_heads
    if recipe.train.precision != "fp8" or tp == 1 or kv % tp == 0:
        return []
    return [f"train.precision=fp8: parallel.tp={tp} replicates model.n_kv_heads={kv} (their gradients are "
            "tp-partial, so fp8 scales cannot match tp=1); use a tp that divides n_kv_heads, or "
            "train.precision=bf16"]


def resolve_dp(recipe: Recipe, world_size: int) -> int:
    """parallel.dp, or world_size / (tp * pp * cp) when the recipe leaves it out."""
    tp_pp = recipe.parallel.tp * recipe.parallel.pp * recipe.parallel.cp
    return recipe.parallel.dp if recipe.parallel.dp is not None else max(1, world_size // tp_pp)


def mesh_problems(recipe: Recipe, world_size: int) -> list[str]:
    """The dp x cp x tp x pp mesh must cover the world, and dp * microbatches must divide the global batch.
    world_size: the mesh's ranks (with parallel.ps_servers, the processes launched minus the servers)."""
    p, t = recipe.parallel, recipe.train
    tp_pp = p.tp * p.pp * p.cp
    servers = p.ps_servers
    after = f" + {servers} server(s) (parallel.ps_servers)" if servers else ""
    cp_name, cp_val = ("*parallel.cp", f"*{p.cp}") if p.cp > 1 else ("", "")
    if world_size % tp_pp:
        return [f"world size {world_size}{' without the servers' if servers else ''} is not divisible by "
                f"parallel.tp*parallel.pp{cp_name}={tp_pp}; launch a multiple of {tp_pp} processes{after}"]
    problems = []
    dp = resolve_dp(recipe, world_size)
    if dp * tp_pp != world_size:
        problems.append(f"parallel.dp*tp*pp{cp_name.replace('parallel.', '')}={dp}*{p.tp}*{p.pp}{cp_val}="
                        f"{dp * tp_pp} does not equal the world size "
                        f"{world_size}{' without the servers' if servers else ''}; launch {dp * tp_pp + servers} "
                        f"processes ({dp * tp_pp} workers{after}) or drop parallel.dp")
    if p.ep > 1 and dp % p.ep:
        problems.append(f"parallel.ep: must divide dp={dp} (the ep group is ep consecutive dp ranks), got {p.ep}; "
                        f"launch a multiple of ep*tp*pp{cp_name.replace('parallel.', '')}={p.ep * tp_pp} processes")
    return problems + batch_problems(t, dp, p.microbatches)


def batch_problems(t: TrainConfig, dp: int, microbatches: int) -> list[str]:
    """Every dp rank takes the same number of whole microbatches of the global batch."""
    if t.global_batch % (dp * microbatches):
        return [f"train.global_batch={t.global_batch} must be divisible by dp*microbatches="
                f"{dp}*{microbatches}={dp * microbatches}"]
    return []


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


def count_rules(schedule: str, pp: int, virtual_stages: int) -> tuple[int, int]:
    """(granule, minimum) of a rank's microbatch count under this schedule: counts are multiples of the
    granule and at least the minimum (schedule_problems' rules, as DynamicBatch moves microbatches)."""
    granule = pp if virtual_stages > 1 and schedule == "interleaved-1f1b" and pp > 1 else 1
    minimum = 2 * pp if schedule == "dualpipev" else granule
    return granule, minimum


def dbs_problems(schedule: str, pp: int, virtual_stages: int, microbatches: int, dp_replicate: int) -> list[str]:
    """Why parallel.dynamic_batch cannot run on this layout (empty when it can)."""
    if dp_replicate < 2:
        return [f"parallel.dynamic_batch: needs dp_replicate = dp/dp_shard >= 2 replicas to move samples "
                f"between, got {dp_replicate}; lower parallel.dp_shard, launch more ranks or drop dynamic_batch"]
    granule, minimum = count_rules(schedule, pp, virtual_stages)
    if microbatches <= minimum:
        return [f"parallel.dynamic_batch: parallel.microbatches={microbatches} leaves no microbatch to move "
                f"(every replica keeps at least {minimum} under schedule {schedule}); raise "
                f"parallel.microbatches to {minimum + granule} or more (train.global_batch with it)"]
    return []


def torchft_layout(recipe: Recipe, world_size: int) -> tuple[int, int, list[str]]:
    """parallel.fault_tolerance=torchft: one torchrun of world_size processes is one replica group of dp_shard
    = world_size / (tp*pp) dp ranks, and parallel.dp counts the dp ranks of every group. Returns (dp,
    dp_shard, every problem); dp_shard is 0 when the world does not divide by tp*pp."""
    p = recipe.parallel
    tp_pp = p.tp * p.pp
    if world_size % tp_pp:
        return 0, 0, [f"world size {world_size} is not divisible by parallel.tp*parallel.pp={tp_pp}; launch a "
                      f"multiple of {tp_pp} processes per replica group"]
    shard = world_size // tp_pp
    dp = p.dp if p.dp is not None else shard
    problems = []
    if p.dp_shard is not None and p.dp_shard != shard:
        problems.append(f"parallel.dp_shard: must equal the dp ranks of one replica group under "
                        f"fault_tolerance=torchft (world size {world_size} / tp*pp {tp_pp} = {shard}), got "
                        f"{p.dp_shard}; drop parallel.dp_shard")
    if dp % shard:
        problems.append(f"parallel.dp={dp}: must be a multiple of the dp ranks of one replica group ({shard} = "
                        f"world size {world_size} / tp*pp {tp_pp}) under fault_tolerance=torchft; set "
                        f"parallel.dp to replica groups x {shard}")
    else:
        problems += batch_problems(recipe.train, dp, p.microbatches)
    return dp, shard, problems


def _divisors(n: int, shown: int = 12) -> str:
    """The divisors of n for an error's hint, at most `shown`: the search stops at 10**6 (a huge key must not
    hang validation), so past 10**12 the list may be partial."""
    limit = min(math.isqrt(n), 10 ** 6) if n >= 1 else 0
    small = [d for d in range(1, limit + 1) if n % d == 0]
    found = sorted(set(small + [n // d for d in small]))
    partial = len(found) > shown or limit < math.isqrt(max(n, 0))
    return ", ".join(map(str, found[:shown])) + (", ..." if partial else "")


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
    if m.num_experts > 0 and m.expert_ffn % tp:
        problems.append(f"parallel.tp: must divide model.moe_intermediate_size={m.expert_ffn} (each expert is "
                        f"split by columns like the MLP), got {tp}; use one of {_divisors(m.expert_ffn)}")
    if m.num_experts > 0 and m.shared_expert_intermediate_size % tp:
        problems.append(f"parallel.tp: must divide model.shared_expert_intermediate_size="
                        f"{m.shared_expert_intermediate_size}, got {tp}; use one of "
                        f"{_divisors(m.shared_expert_intermediate_size)}")
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
