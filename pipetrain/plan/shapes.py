"""The parameters a rank holds, by arithmetic: local shapes of one rank's share of the model, with no layer
built (so a size check on a recipe with a million layers answers at once). A rank holds its pp stage(s)'
layers split tp ways the way parallel/tensor/layers.py splits them (column: output rows / tp, row: input
columns / tp with the bias replicated, kv: split when tp divides n_kv_heads, else replicated; embedding and
head: vocab rows / tp; norms replicated; experts: num_experts / ep of them, F-sharded over tp). The tied head
on a last stage that is not on the first stage's rank is a copy; rank_stages says which layers (and ends) a pp
rank holds. pipetrain.plan.memory builds on these."""
from __future__ import annotations

import dataclasses
import functools

from pipetrain.config import ModelConfig, ParallelConfig, Recipe, lora_projections
from pipetrain.parallel.pipeline.schedules import placement_of, rank_chunk_of
from pipetrain.parallel.pipeline.stage import stage_layout


def kv_rows(m: ModelConfig, tp: int) -> int:
    """Rows of wk / wv a tp rank holds: its share of the kv heads, or all of them when replicated."""
    return m.kv_heads * m.head_dim // tp if m.kv_heads % tp == 0 else m.kv_heads * m.head_dim


def expert_shapes(m: ModelConfig, tp: int, ep: int = 1) -> list[tuple[int, ...]]:
    """One block's stacked expert weights on one rank: E/ep experts, F-sharded over tp."""
    E, Fe, D = m.num_experts // ep, m.expert_ffn // tp, m.d_model
    return [(E, Fe, D), (E, Fe, D), (E, D, Fe)] if m.is_moe else []


def lora_elements(m: ModelConfig) -> int:
    """Elements of one block's LoRA adapters (A: rank x in, B: out x rank per adapted projection), counted whole
    on every rank (an upper bound under tp); 0 without LoRA."""
    if m.lora_rank is None:
        return 0
    D, q, kv, F = m.d_model, m.n_heads * m.head_dim, m.kv_heads * m.head_dim, m.ffn
    sides = {"wq": D + q, "wk": D + kv, "wv": D + kv, "wo": q + D, "gate": D + F, "up": D + F, "down": F + D}
    return m.lora_rank * sum(sides[name] for name in m.lora_targets or lora_projections(m.family, m.is_moe))


def param_shapes(m: ModelConfig, tp: int, layers: list[int], first: bool, last: bool,
                 tied_copy: bool, servers: bool = False, ep: int = 1) -> list[tuple[int, ...]]:
    """Local shapes of the parameters of one rank holding `layers` (and the embedding if first, the final
    norm and head if last; the head is a copy of the tied embedding when tied_copy). servers: parameter
    servers hold the input embedding (a first stage has none). ep: experts are split ep ways."""
    D, K, Fh, V = m.d_model, m.head_dim, m.ffn, m.vocab_size
    gpt2 = m.family == "gpt2"
    qkv_bias = m.has_qkv_bias or gpt2
    norm = [(D,), (D,)] if gpt2 else [(D,)]
    q_rows, kv_local = m.n_heads * K // tp, kv_rows(m, tp)
    block = norm + [(q_rows, D), (kv_local, D), (kv_local, D), (D, m.n_heads * K // tp)]
    block += [(q_rows,), (kv_local,), (kv_local,)] if qkv_bias else []
    block += [(D,)] if gpt2 else []  # wo bias, replicated
    block += [(K,), (K,)] if m.has_qk_norm else []  # q/k norms, replicated
    if m.is_moe:  # router (replicated), E/ep experts F-sharded like the MLP, the shared MLP
        Fs = m.shared_expert_intermediate_size // tp
        block += norm + [(m.num_experts, D)] + expert_shapes(m, tp, ep) + ([(Fs, D), (Fs, D), (D, Fs)] if Fs else [])
    else:
        block += norm + ([] if gpt2 else [(Fh // tp, D)]) + [(Fh // tp, D), (D, Fh // tp)]
    block += [(Fh // tp,), (D,)] if gpt2 else []  # up bias split, down bias replicated
    shapes = []
    if first:
        if not servers:
            shapes.append((V // tp, D))
        if gpt2:
            shapes.append((m.max_seq_len, D))
    shapes += block * len(layers)
    if last:
        shapes += norm
        if not m.tied or tied_copy:
            shapes.append((V // tp, D))
    return shapes


def model_params(m: ModelConfig) -> int:
    """Parameters of the whole model (count_params of a build), by arithmetic: no layer is built, so a
    size check on a recipe with a million layers answers at once."""
    ends = sum(numel(s) for s in param_shapes(m, 1, [], True, True, False))
    block = sum(numel(s) for s in param_shapes(m, 1, [0], False, False, False))
    return ends + m.n_layers * block


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def rows_numel(shape: tuple[int, ...], dp: int) -> int:
    """Elements of dp rank 0's row shard (the largest) of a parameter of this local shape."""
    rows = -(-shape[0] // dp)  # dp_row_ranges gives rank 0 the ceiling
    return rows * numel(shape) // shape[0]


@functools.lru_cache(maxsize=1024)
def _stages(m: ModelConfig, pp: int, virtual_stages: int, stage_layers: tuple | None, seq_len: int,
            schedule: str) -> tuple:
    """pipeline.stage_layout, cached: the search asks for the same split for many layouts. m must be
    hashable (_hashable_model)."""
    pcfg = ParallelConfig(pp=pp, virtual_stages=virtual_stages, schedule=schedule,
                          stage_layers=list(stage_layers) if stage_layers else None)
    return tuple(tuple(s) for s in stage_layout(m, pcfg, seq_len))


def _hashable_model(m: ModelConfig) -> ModelConfig:
    """m with its list fields as tuples, so it can key a cache (a frozen dataclass with a list does not hash)."""
    return dataclasses.replace(m, **{f.name: tuple(getattr(m, f.name)) for f in dataclasses.fields(m)
                                     if isinstance(getattr(m, f.name), list)})


def rank_stages(recipe: Recipe, pp_rank: int) -> tuple[list[int], bool, bool, bool]:
    """(global layers, holds stage 0, holds the last stage, holds a tied head copy) of a pp rank."""
    stages, mine = _rank_stages(recipe, pp_rank)
    first, last = 0 in mine, len(stages) - 1 in mine
    return [i for s in mine for i in stages[s]], first, last, recipe.model.tied and last and not first


def rank_stage_layers(recipe: Recipe, pp_rank: int) -> list[tuple[int, ...]]:
    """The global layers of each stage a pp rank holds, in stage order."""
    stages, mine = _rank_stages(recipe, pp_rank)
    return [tuple(stages[s]) for s in mine]


def _rank_stages(recipe: Recipe, pp_rank: int) -> tuple[tuple, list[int]]:
    """(every stage's layers, the stages pp_rank holds)."""
    p = recipe.parallel
    if p.pp * p.virtual_stages == 1:  # one stage: no partition to compute (a million layers answers at once)
        stages = (tuple(range(recipe.model.n_layers)),)
    else:
        stages = _stages(_hashable_model(recipe.model), p.pp, p.virtual_stages,
                         tuple(p.stage_layers or ()) or None, recipe.train.seq_len, p.schedule)
    placement = placement_of(p.schedule)
    return stages, [s for s in range(len(stages)) if rank_chunk_of(s, p.pp, placement)[0] == pp_rank]
