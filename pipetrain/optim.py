"""The optimizer the trainer drives, and the learning-rate schedule.

build_optimizer returns replicated AdamW (Optimizer, parallel.zero = 0) or ZeRO-sharded AdamW
(pipetrain.parallel.zero, parallel.zero = 1 | 2); both have the same interface: zero_grad();
backward...; reduce_grads(); clip_grad_norm(max_norm) -> global norm; step(lr); state_items() /
load_state_items(read) for checkpoints (pipetrain.parallel.adamw describes the state boxes).
lr_at is the learning-rate schedule (train.lr_schedule, with warmup: pipetrain.lr_schedule).
"""
from __future__ import annotations


import torch
import torch.nn as nn

from pipetrain import lr_schedule
from pipetrain.config import TrainConfig
from pipetrain.parallel.adamw import (ReadBox, StateEntry, adamw_state_bytes, adamw_state_items, build_adamw,
                                      is_tied, load_adamw_state, param_boxes, param_groups, set_lr)
from pipetrain.parallel.grads import clip_grad_norm, sync_grads, tied_copy_names
from pipetrain.parallel.zero import ZeroOptimizer


class Optimizer:
    """AdamW over this rank's parameters with replicated state (parallel.zero = 0).

    The trainer drives every optimizer the same way, so ZeRO (pipetrain.parallel.zero) is a drop-in:
    zero_grad(); backward...; reduce_grads(); clip_grad_norm(max_norm) -> global norm; step(lr).
    """

    def __init__(self, model: nn.Module, dims, cfg: TrainConfig):
        self.model, self.dims, self.cfg = model, dims, cfg
        self.inner = build_adamw(param_groups(model, cfg.weight_decay), cfg)
        self.steps_taken = 0

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def reduce_grads(self) -> None:
        sync_grads(self.model, self.dims)

    def clip_grad_norm(self, max_norm: float) -> float:
        return clip_grad_norm(self.model, self.dims, max_norm)

    def step(self, lr: float) -> None:
        set_lr(self.inner, lr)
        self.inner.step()
        self.steps_taken += 1

    def _entries(self) -> list[StateEntry]:
        return [e for e in param_boxes(self.model) if e[1].requires_grad]

    def state_items(self) -> list[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
        """(name, local tensor, global shape, offsets) of every optimizer tensor this rank owns."""
        skip = tied_copy_names(self.model)
        return adamw_state_items(self.inner, [e for e in self._entries() if e[0] not in skip], self.steps_taken)

    def load_state_items(self, read: ReadBox) -> None:
        """Load every moment this rank needs (the tied head copy from its embedding's entries)."""
        self.steps_taken = load_adamw_state(self.inner, self._entries(), read, is_tied(self.model))

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank (the AdamW moments; 0 before the first step)."""
        return adamw_state_bytes(self.inner)


def build_optimizer(model: nn.Module, dims, cfg: TrainConfig, zero: int = 0):
    """The optimizer for parallel.zero: replicated AdamW (0) or ZeRO-sharded across dp (1, 2)."""
    if zero == 0 or dims.dp == 1:
        return Optimizer(model, dims, cfg)
    return ZeroOptimizer(model, dims, cfg, stage=zero)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (1-based): warmup, then train.lr_schedule (lr_schedule.py)."""
    return lr_schedule.lr_at(step, cfg)
