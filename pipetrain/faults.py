"""Fault injection for drills and tests (the recipe's `faults` section): injected stragglers and kills.

A rank in faults.slow_ranks is slow at a step with probability faults.slow_prob, decided by a generator
seeded with (faults.seed, step, rank), so a run's straggler pattern is reproducible and independent of
timing (slow_prob 1: persistent, < 1: transient). A slow step takes slow_factor times its compute: the
rank sleeps (slow_factor - 1) x the compute time it measured for that step (forward and backward),
inside the step, before its gradients are reduced. A kill (faults.kill_rank, faults.kill_at_step) makes
that global rank SIGKILL itself as step kill_at_step begins, on the first attempt only
(TORCHELASTIC_RESTART_COUNT 0), so a run under `torchrun --max-restarts N` restarts once and then
trains through. Tests inject stragglers and kills through this module and never sleep by hand.
"""
from __future__ import annotations

import os
import random
import signal
import sys
import time

from pipetrain.config import FaultsConfig


class Faults:
    """This rank's injected faults."""

    def __init__(self, cfg: FaultsConfig, rank: int):
        self.cfg, self.rank = cfg, rank
        self.slow = rank in cfg.slow_ranks and cfg.slow_factor > 1 and cfg.slow_prob > 0

    @property
    def enabled(self) -> bool:
        return bool(self.cfg.slow_ranks) and self.cfg.slow_factor > 1 and self.cfg.slow_prob > 0

    @property
    def kills(self) -> bool:
        """Whether a kill is armed in this attempt (the first one: torchrun's restarts run through)."""
        c = self.cfg
        return c.kill_rank is not None and c.kill_at_step is not None and restart_count() == 0

    def announce(self) -> None:
        """Say loudly that faults are injected (once, from global rank 0)."""
        if self.rank != 0:
            return
        c = self.cfg
        if self.enabled:
            print(f"WARNING: FAULT INJECTION ON: ranks {list(c.slow_ranks)} are slow (x{c.slow_factor} compute) "
                  f"with probability {c.slow_prob} per step (seed {c.seed}); timings of this run are not real",
                  file=sys.stderr, flush=True)
        if self.kills:
            print(f"WARNING: FAULT INJECTION ON: rank {c.kill_rank} will be killed (SIGKILL) as step "
                  f"{c.kill_at_step} begins, in this first attempt only", file=sys.stderr, flush=True)

    def maybe_kill(self, step: int) -> None:
        """SIGKILL this process when it is the armed rank and `step` (1-based) is about to begin."""
        if self.kills and self.rank == self.cfg.kill_rank and step == self.cfg.kill_at_step:
            print(f"faults: killing rank {self.rank} at the start of step {step} (SIGKILL)", file=sys.stderr,
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def is_slow(self, step: int) -> bool:
        """Whether this rank's step `step` (1-based) is slow: the same answer on every run."""
        if not self.slow:
            return False
        if self.cfg.slow_prob >= 1:
            return True
        return random.Random(f"{self.cfg.seed}/{step}/{self.rank}").random() < self.cfg.slow_prob

    def straggle(self, step: int, compute_s: float) -> float:
        """Sleep (slow_factor - 1) x compute_s when this step is slow; returns the seconds slept."""
        if not self.is_slow(step):
            return 0.0
        delay = (self.cfg.slow_factor - 1) * compute_s
        time.sleep(delay)
        return delay


def restart_count() -> int:
    """How many times torchrun's elastic agent restarted this worker group (0: the first attempt)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0
