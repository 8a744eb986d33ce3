"""Pipeline stages: partition the decoder's layers and keep this rank's part.

A pipeline of pp ranks with v virtual stages per rank has S = pp * v stages; chunk c of pp rank r is
stage s = c * pp + r (Megatron's interleaving), or, for the V schedules (zbv, dualpipev: v = 2), stage r
for chunk 0 and 2*pp-1-r for chunk 1, so rank 0 holds the first and the last stage
(schedules.stage_of). Stage 0 also holds the embedding, stage S-1 the final
norm, the LM head and the loss. Layers go to stages by a cost model (per-layer training FLOPs, the
embedding's parameter memory and the head's FLOPs; docs/pipeline.md) or an explicit
parallel.stage_layers list.

build_stage prunes the (meta) model in place to the union of this rank's chunks, so parameter names
stay global (layers.17.mlp.up.weight); each chunk is a shallow view of that module that runs only its
own layers. When embeddings are tied and the first and last stage live on different ranks, the last
stage gets its own copy of the weight (initialised from the same global name, "embed.weight") and
the two gradients are summed over dims.embed_group every step.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn

from pipetrain.config import ModelConfig, ParallelConfig
from pipetrain.parallel.pipeline.schedules.actions import placement_of, rank_chunk_of, stage_of


@dataclass(frozen=True)
class ChunkSpec:
    stage: int                 # global stage index
    layers: tuple[int, ...]    # global layer indices, in order
    is_first: bool             # holds the embedding
    is_last: bool              # holds the final norm, head and loss


def layer_costs(cfg: ModelConfig, seq_len: int) -> tuple[float, float, float]:
    """(one transformer block, the embedding, the head + loss) in forward FLOPs per token.

    The embedding does no matmul; it is charged as one block's worth when its table is larger than
    a block (it dominates a stage's memory and its optimizer step), else nothing."""
    D, K = cfg.d_model, cfg.head_dim
    block = 2 * D * K * (2 * cfg.n_heads + 2 * cfg.kv_heads) + 2 * D * cfg.ffn * (3 if cfg.family != "gpt2" else 2)
    block += 2 * cfg.n_heads * K * seq_len  # causal attention: 4*Hq*K*T/2
    embed = block if cfg.vocab_size * D > 12 * D * D else 0.0
    head = 2 * D * cfg.vocab_size
    return float(block), float(embed), float(head)


def partition_layers(cfg: ModelConfig, num_stages: int, seq_len: int, pp: int | None = None,
                     placement: str = "loop") -> list[int]:
    """Layers per stage (each >= 1) minimising the most expensive stage; ties favour earlier stages.

    Interleaved (pp given, num_stages = pp * v with v > 1): rank r runs stages r, r + pp, ..., so in the
    steady state the step is paced by the busiest rank, not the busiest stage. The stage-balanced
    partition is then improved by moving one layer at a time across a stage boundary while that lowers
    (busiest rank, busiest stage) and no stage grows past the stage-balanced optimum (the fill and
    drain pass through single stages): with the head on the last stage, the stage-balanced split overloads
    the last rank (pp 2, v 2, 8 layers: [2, 3, 2, 1] loads the ranks 5.0 / 6.7 blocks, [2, 2, 3, 1]
    6.0 / 5.7). The V placement (placement "v") is balanced the same way over its ranks: rank 0 holds
    stages 0 and S-1, so the embedding and the head both load it, and the descent moves layers off it."""
    L = cfg.n_layers
    assert 1 <= num_stages <= L, f"partition_layers: {num_stages} stages for {L} layers; layout_problems rejects this"
    block, embed, head = layer_costs(cfg, seq_len)

    def cost(stage: int, n: int) -> float:
        return n * block + (embed if stage == 0 else 0.0) + (head if stage == num_stages - 1 else 0.0)

    # best[s][l]: minimal max-cost of placing the first l layers on the first s stages
    inf = float("inf")
    best = [[inf] * (L + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (L + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for l in range(s, L - (num_stages - s) + 1):
            for n in range(1, l - (s - 1) + 1):
                value = max(best[s - 1][l - n], cost(s - 1, n))
                if value < best[s][l] - 1e-9:
                    best[s][l], choice[s][l] = value, n
    counts, l = [], L
    for s in range(num_stages, 0, -1):
        counts.append(choice[s][l])
        l -= choice[s][l]
    counts = counts[::-1]
    if pp is None or num_stages <= pp:
        return counts

    def score(c: list[int]) -> tuple[float, float]:
        stage = [cost(s, n) for s, n in enumerate(c)]
        loads = [0.0] * pp
        for s, x in enumerate(stage):
            loads[rank_chunk_of(s, pp, placement)[0]] += x
        return max(loads), max(stage)

    current, cap = score(counts), max(cost(s, n) for s, n in enumerate(counts)) + 1e-9
    while True:  # steepest descent over single-layer moves; each move strictly lowers the score
        moves = []
        # Counts move between neighbouring stages; in the V between any two (a rank's stages are apart).
        pairs = ([(a, b) for a in range(num_stages) for b in range(num_stages) if a != b] if placement == "v"
                 else [pair for s in range(num_stages - 1) for pair in ((s, s + 1), (s + 1, s))])
        for src, dst in pairs:
            if counts[src] > 1 and cost(dst, counts[dst] + 1) <= cap:
                c = list(counts)
                c[src], c[dst] = c[src] - 1, c[dst] + 1
                moves.append((score(c), c))
        if not moves:
            return counts
        value, c = min(moves, key=lambda m: m[0])
        lower_rank = value[0] < current[0] - 1e-9
        same_rank_lower_stage = abs(value[0] - current[0]) <= 1e-9 and value[1] < current[1] - 1e-9
        if not (lower_rank or same_rank_lower_stage):
            return counts
        counts, current = c, value


def stage_costs(cfg: ModelConfig, pcfg: ParallelConfig, seq_len: int) -> list[float]:
    """Forward time of every stage of the layout in blocks (FLOPs): its layers, plus the head and loss on the
    last stage. The embedding is a row lookup, nearly free in time (the partition charges it for memory)."""
    block, _, head = layer_costs(cfg, seq_len)
    layouts = stage_layout(cfg, pcfg, seq_len)
    return [len(layers) + (head / block if s == len(layouts) - 1 else 0.0) for s, layers in enumerate(layouts)]


def stage_layout(cfg: ModelConfig, pcfg: ParallelConfig, seq_len: int) -> list[list[int]]:
    """Global layer indices of every stage, for a layout that layout_problems accepts."""
    num_stages = pcfg.pp * pcfg.virtual_stages
    if pcfg.stage_layers is not None:
        counts = list(pcfg.stage_layers)
        assert len(counts) == num_stages and min(counts, default=0) >= 1 and sum(counts) == cfg.n_layers, \
            f"stage_layout: stage_layers={counts} is not {num_stages} stages of {cfg.n_layers} layers; " \
            "layout_problems rejects this"
    else:
        counts = partition_layers(cfg, num_stages, seq_len, pcfg.pp, placement_of(pcfg.schedule))
    out, start = [], 0
    for n in counts:
        out.append(list(range(start, start + n)))
        start += n
    return out


def _shallow_view(model: nn.Module) -> nn.Module:
    """A copy of model whose submodules can be swapped without touching model (parameters shared)."""
    view = copy.copy(model)
    view._modules = dict(model._modules)
    return view


def without_head(chunk: nn.Module) -> nn.Module:
    """A last-stage chunk that stops at the final norm (train.fused_loss: the loss applies the head)."""
    view = _shallow_view(chunk)
    view.head = None
    return view


def _chunk_view(model: nn.Module, spec: ChunkSpec) -> nn.Module:
    """A shallow copy of the rank's module that runs only spec's layers (parameters shared)."""
    view = _shallow_view(model)
    view.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in spec.layers})
    if not spec.is_first:
        view.embed = None
        if getattr(view, "pos_embed", None) is not None:
            view.pos_embed = None
    if not spec.is_last:
        view.norm = None
        view.head = None
    return view


def build_stage(model: nn.Module, dims, pcfg: ParallelConfig, seq_len: int) -> tuple[nn.Module, list[nn.Module],
                                                                                        list[ChunkSpec]]:
    """Prune model in place to this pp rank's chunks; returns (model, chunk modules, chunk specs).

    With pp == 1 the model is unchanged and is its own single chunk."""
    cfg: ModelConfig = model.cfg
    layout = stage_layout(cfg, pcfg, seq_len)
    num_stages = len(layout)
    stages = [stage_of(dims.pp_rank, c, dims.pp, placement_of(pcfg.schedule)) for c in range(pcfg.virtual_stages)]
    specs = [ChunkSpec(stage=s, layers=tuple(layout[s]), is_first=s == 0, is_last=s == num_stages - 1)
             for s in stages]
    if num_stages == 1:
        return model, [model], specs
    keep = {i for spec in specs for i in spec.layers}
    for name in list(model.layers.keys()):
        if int(name) not in keep:
            del model.layers[name]
    has_first = any(s.is_first for s in specs)
    has_last = any(s.is_last for s in specs)
    tied = model.embed is not None and model.head is not None and model.head.weight is model.embed.weight
    if not has_first:
        model.embed = None
        if getattr(model, "pos_embed", None) is not None:
            model.pos_embed = None
    if not has_last:
        model.norm = None
        model.head = None
    elif tied and not has_first:  # the last stage's own copy of the tied embedding
        model.head.weight = nn.Parameter(torch.empty_like(model.head.weight))
    return model, [_chunk_view(model, s) for s in specs], specs
