"""AdamW with the usual no-decay groups, and the warmup + cosine learning-rate schedule."""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from pipetrain.config import TrainConfig

_NO_DECAY_MODULES = ("embed", "pos_embed")


def decays(name: str, p: torch.Tensor) -> bool:
    """Weight decay applies to matrices, not to norms, biases or embeddings."""
    return p.dim() >= 2 and name.split(".")[0] not in _NO_DECAY_MODULES


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if decays(name, p) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    # foreach keeps the per-parameter loop out of Python; fused is CUDA-only in some torch builds.
    fused = all(p.is_cuda for p in model.parameters())
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=1e-8, fused=fused or None, foreach=None if fused else True)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (1-based): linear warmup, then cosine decay to min_lr."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
