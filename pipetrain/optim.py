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


def build_adamw(params_or_groups, cfg: TrainConfig) -> torch.optim.AdamW:
    # foreach keeps the per-parameter loop out of Python; fused is CUDA-only in some torch builds.
    fused = all(p.is_cuda for g in params_or_groups for p in (g["params"] if isinstance(g, dict) else [g]))
    return torch.optim.AdamW(params_or_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                             fused=fused or None, foreach=None if fused else True)


class Optimizer:
    """AdamW over this rank's parameters with replicated state (parallel.zero = 0).

    The trainer drives every optimizer the same way, so ZeRO (pipetrain.parallel.zero) is a drop-in:
    zero_grad(); backward...; reduce_grads(); clip_grad_norm(max_norm) -> global norm; step(lr).
    """

    def __init__(self, model: nn.Module, dims, cfg: TrainConfig):
        self.model, self.dims, self.cfg = model, dims, cfg
        self.inner = build_adamw(param_groups(model, cfg.weight_decay), cfg)

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def reduce_grads(self) -> None:
        from pipetrain.parallel.grads import sync_grads
        sync_grads(self.model, self.dims)

    def clip_grad_norm(self, max_norm: float) -> float:
        from pipetrain.parallel.grads import clip_grad_norm
        return clip_grad_norm(self.model, self.dims, max_norm)

    def step(self, lr: float) -> None:
        set_lr(self.inner, lr)
        self.inner.step()


def build_optimizer(model: nn.Module, dims, cfg: TrainConfig, zero: int = 0):
    """The optimizer for parallel.zero: replicated AdamW (0) or ZeRO-sharded across dp (1, 2)."""
    if zero == 0 or dims.dp == 1:
        return Optimizer(model, dims, cfg)
    from pipetrain.parallel.zero import ZeroOptimizer
    return ZeroOptimizer(model, dims, cfg, stage=zero)


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
