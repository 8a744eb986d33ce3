"""Learning-rate schedules: linear warmup, then cosine | linear | constant | wsd.

Every schedule is a pure function of the 1-based optimizer step and the train config, so a resumed
run recomputes the same rate from its step count and nothing needs saving.

  warmup   steps 1..warmup_steps rise linearly: lr * step / warmup_steps
  cosine   then lr -> min_lr along half a cosine, reaching min_lr at train.steps (the default)
  linear   then lr -> min_lr in a straight line, reaching min_lr at train.steps
  constant then lr until the end (min_lr is not used)
  wsd      warmup-stable-decay: lr until the last decay_fraction * train.steps steps (rounded to
           the nearest step, halves to even), which fall linearly to min_lr, reaching it at
           train.steps. The stable phase never starts before warmup ends: a decay longer than the
           steps after warmup starts right after warmup.
"""
from __future__ import annotations

import math

from pipetrain.config import TrainConfig

SCHEDULES = ("cosine", "linear", "constant", "wsd")


def warmup_factor(step: int, warmup_steps: int) -> float:
    return step / warmup_steps if warmup_steps and step <= warmup_steps else 1.0


def decay_start(cfg: TrainConfig) -> int:
    """The last step at full lr before the decay phase (warmup's end for cosine and linear)."""
    if cfg.lr_schedule == "wsd":
        return max(cfg.warmup_steps, cfg.steps - round(cfg.decay_fraction * cfg.steps))
    return cfg.warmup_steps


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (1-based) under cfg.lr_schedule."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * warmup_factor(step, cfg.warmup_steps)
    if cfg.lr_schedule == "constant":
        return cfg.lr
    start = decay_start(cfg)
    if step <= start:  # wsd's stable phase
        return cfg.lr
    progress = min(1.0, (step - start) / max(1, cfg.steps - start))
    if cfg.lr_schedule == "cosine":
        return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))
    return cfg.lr + (cfg.min_lr - cfg.lr) * progress  # linear and wsd's decay
