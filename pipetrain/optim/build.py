"""The optimizer the trainer drives, and the learning-rate schedule.

build_optimizer returns replicated AdamW (Optimizer, parallel.zero = 0) or ZeRO-sharded AdamW
(pipetrain.parallel.data.zero, parallel.zero = 1 | 2); both have the same interface: zero_grad();
backward...; reduce_grads(); clip_grad_norm(max_norm) -> global norm; step(lr); state_items() /
load_state_items(read) for checkpoints (pipetrain.optim.adamw describes the state boxes).
lr_at is the learning-rate schedule (train.lr_schedule, with warmup: pipetrain.lr_schedule).
"""
from __future__ import annotations


import torch
import torch.nn as nn

from pipetrain import lr_schedule
from pipetrain.config import TrainConfig
# build_adamw is re-exported for benchmarks/foundation.py's plain-PyTorch baseline
from pipetrain.optim.adamw import (ReadBox, StateEntry, build_adamw, is_tied, param_boxes,  # noqa: F401
                                   param_groups, set_lr)
from pipetrain.optim.inner import build_inner, inner_state_bytes, inner_state_items, load_inner_state
from pipetrain.parallel.data.grads import clip_grad_norm, sync_grads, tied_copy_names
from pipetrain.parallel.replicas.relaxed import RelaxedOptimizer, needs_relaxed
from pipetrain.parallel.data.zero import ZeroOptimizer


class Optimizer:
    """AdamW over this rank's parameters with replicated state (parallel.zero = 0).

    The trainer drives every optimizer the same way, so ZeRO (pipetrain.parallel.data.zero) is a drop-in:
    zero_grad(); backward...; reduce_grads(); clip_grad_norm(max_norm) -> global norm; step(lr).
    """

    def __init__(self, model: nn.Module, dims, cfg: TrainConfig, dp_group="dp"):
        """dp_group: the group gradients are summed over ("dp": dims.dp_group; a relaxed run passes its
        dp_shard group, and pipetrain.parallel.replicas.relaxed reduces across replicas)."""
        self.model, self.dims, self.cfg = model, dims, cfg
        self.dp_group = dims.dp_group if dp_group == "dp" else dp_group
        self.inner = build_inner(param_groups(model, cfg.weight_decay), cfg)
        self.steps_taken = 0

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def reduce_grads(self) -> None:
        sync_grads(self.model, self.dims, self.dp_group)

    def clip_grad_norm(self, max_norm: float) -> float:
        return clip_grad_norm(self.model, self.dims, max_norm, extra_sq=getattr(self, "extra_grad_sq", 0.0))

    def step(self, lr: float) -> None:
        set_lr(self.inner, lr)
        self.inner.step()
        self.steps_taken += 1

    def _entries(self) -> list[StateEntry]:
        return [e for e in param_boxes(self.model) if e[1].requires_grad]

    def state_items(self) -> list[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
        """(name, local tensor, global shape, offsets) of every optimizer tensor this rank owns."""
        skip = tied_copy_names(self.model)
        return inner_state_items(self.inner, [e for e in self._entries() if e[0] not in skip], self.steps_taken)

    def load_state_items(self, read: ReadBox) -> None:
        """Load every moment this rank needs (the tied head copy from its embedding's entries)."""
        self.steps_taken = load_inner_state(self.inner, self._entries(), read, is_tied(self.model))

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank (the AdamW moments; 0 before the first step)."""
        return inner_state_bytes(self.inner)


def build_optimizer(model: nn.Module, dims, cfg: TrainConfig, zero: int = 0, parallel=None, start_step: int = 0):
    """The optimizer for parallel.zero: replicated (0) or ZeRO-sharded across dp_shard (1, 2), train.optimizer
    inside; wrapped in pipetrain.parallel.replicas.relaxed.RelaxedOptimizer when parallel.dp_sync is relaxed or the
    replicas must be reduced after the shards (parallel: the recipe's ParallelConfig; None = bsp)."""
    relaxed = parallel is not None and needs_relaxed(parallel, dims, zero)
    if zero == 0 or dims.dp_shard == 1:
        inner = Optimizer(model, dims, cfg, dp_group=dims.dp_shard_group if relaxed else "dp")
    else:
        inner = ZeroOptimizer(model, dims, cfg, stage=zero)
    return RelaxedOptimizer(inner, dims, parallel, cfg, start_step) if relaxed else inner


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (1-based): warmup, then train.lr_schedule (lr_schedule.py)."""
    return lr_schedule.lr_at(step, cfg)
