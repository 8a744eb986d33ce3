"""Activation recomputation: trade compute for activation memory.

- full: each transformer block keeps only its input; its forward runs again during backward.
  parallel.recompute_layers = N limits this to the first N blocks of each stage (Megatron's
  "block" granularity), the rest keep their activations. A rank holding several stages (chunks:
  interleaved-1f1b, the V schedules) applies the limit to each: the stages come from the pipeline
  split (build_stage's specs); without them, runs of consecutive global layer indices stand for stages
  (one stage per rank, or interleaving, where other ranks' stages separate a rank's; not the V
  placement, whose last rank holds two adjacent stages).
- selective: only the attention core (softmax(q k^T) v, the part whose activations grow with T^2
  and cost few FLOPs to redo) is recomputed, as in Korthikanti et al. 2022.

Non-reentrant torch.utils.checkpoint with the RNG state preserved, so the recomputed forward is
bitwise the original one and losses and gradients do not change. The model has no dropout, so RNG
preservation is belt and braces; it keeps the guarantee if dropout is ever added.
The module's class is swapped for a subclass whose forward checkpoints the class's own (not wrapped
in a new module), so parameter names, and with them checkpoints and initialisation, do not change.
One subclass per class, shared by every layer: under train.compile the blocks share one graph, where a
forward of each instance's own (a functools.partial apiece) made dynamo retrace the block for each layer
and fail at its recompile limit from 5 layers a stage (tests/unit/test_compile.py).
"""
from __future__ import annotations

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from pipetrain.config import ParallelConfig

_RECOMPUTED: dict[type, type] = {}  # a module class -> its recomputing subclass


def _recomputing_class(cls: type) -> type:
    if cls not in _RECOMPUTED:
        own_forward = cls.forward

        def forward(self, *args, **kwargs):
            return checkpoint(own_forward, self, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
        _RECOMPUTED[cls] = type(f"Recomputed{cls.__name__}", (cls,),
                                {"forward": forward, "recomputed": True, "__module__": cls.__module__})
    return _RECOMPUTED[cls]


def _recompute(module: nn.Module) -> None:
    module.__class__ = _recomputing_class(type(module))


def apply_recompute(model: nn.Module, pcfg: ParallelConfig, stages: list | None = None) -> list[str]:
    """Mark this stage's blocks (full) or attention cores (selective) for recomputation, in place.
    stages: each stage's global layer indices on this rank (ChunkSpec.layers); None: runs of consecutive
    indices. Returns the names of the recomputed modules."""
    if pcfg.recompute == "none":
        return []
    if any(getattr(m, "recomputed", False) for m in model.modules()):
        raise ValueError("apply_recompute: the model already recomputes some modules; apply it once "
                         "(nesting checkpoints would run those forwards three times)")
    names = []
    blocks = list(model.layers.items())
    if pcfg.recompute == "full":
        by_index = dict(blocks)
        runs = _stage_runs(blocks) if stages is None else \
            [[(str(i), by_index[str(i)]) for i in layers if str(i) in by_index] for layers in stages]
        for run in runs:
            limit = len(run) if pcfg.recompute_layers is None else pcfg.recompute_layers
            for name, block in run[:limit]:
                _recompute(block)
                names.append(f"layers.{name}")
    elif pcfg.recompute == "selective":
        for name, block in blocks:
            _recompute(block.attn.core)
            names.append(f"layers.{name}.attn.core")
    return names


def _stage_runs(blocks: list[tuple[str, nn.Module]]) -> list[list[tuple[str, nn.Module]]]:
    """Split (global layer index, block) pairs into runs of consecutive indices: one per stage held."""
    runs: list[list[tuple[str, nn.Module]]] = []
    for name, block in sorted(blocks, key=lambda item: int(item[0])):
        if runs and int(runs[-1][-1][0]) + 1 == int(name):
            runs[-1].append((name, block))
        else:
            runs.append([(name, block)])
    return runs
