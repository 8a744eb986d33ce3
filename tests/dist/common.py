"""What the multi-process tests of replicas share: a small trainer over synthetic tokens."""
from __future__ import annotations

import numpy as np

from pipetrain.build import build_trainer
from pipetrain.config import FaultsConfig, ParallelConfig, Recipe, RunConfig, TrainConfig
from pipetrain.data import Loader, PackedData
from tests.unit.common import LLAMA


def replica_recipe(out, dims, *, steps: int, optimizer="adamw", momentum=0.0, grad_clip=1.0, lr=1e-2, faults=None,
                   model=LLAMA, **parallel) -> Recipe:
    """The recipe of replica_trainer (global batch 8 of 16 tokens, parallel keys as given)."""
    return Recipe(model=model, parallel=ParallelConfig(tp=dims.tp, pp=dims.pp, **parallel),
                  train=TrainConfig(steps=steps, global_batch=8, seq_len=16, lr=lr, min_lr=lr / 10, warmup_steps=1,
                                    grad_clip=grad_clip, optimizer=optimizer, momentum=momentum,
                                    grad_accumulation_fusion_min_numel=0),
                  run=RunConfig(output_dir=out, progress=False), faults=faults or FaultsConfig())


def replica_trainer(out, dims, *, steps: int, resume=None, **keys):
    """A Trainer for dims (replica_recipe's keys: LLAMA, parallel keys as given) over fixed random tokens;
    resume: a checkpoint directory or None."""
    recipe = replica_recipe(out, dims, steps=steps, **keys)
    rng = np.random.default_rng(0)
    num = 64 * 17
    vocab = recipe.model.vocab_size
    data = PackedData(rng.integers(0, vocab, num).astype(np.int32), np.ones(num, dtype=bool), 16, 0.0, 2)
    return build_trainer(recipe, dims, loader=Loader(data, 8, dims.dp_rank, dims.dp), resume=resume)
