"""What the benchmarks share: the repository root on sys.path, running a function on gloo processes, and
a median timer.

The benchmarks run as scripts (`python benchmarks/NAME.py`), so Python puts benchmarks/ first on sys.path
and `from common import run_ranks` finds this file; this file puts the repository root there too, so
pipetrain and tests.harness import from the checkout even without `pip install -e .`. The process
harness is tests/harness.py's (one copy in the repository); this adds only rank 0's return value.
"""
from __future__ import annotations

import os
import pickle
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.harness import run_ranks as _run_ranks  # noqa: E402  (needs ROOT on sys.path)


def _keep_rank0_result(rank: int, world_size: int, fn, out_path: str, args: tuple) -> None:
    result = fn(rank, world_size, *args)
    if rank == 0:
        with open(out_path, "wb") as f:
            pickle.dump(result, f)


def run_ranks(world_size: int, fn, *args, timeout_s: float = 600):
    """Run fn(rank, world_size, *args) on world_size gloo processes (1 thread each, file rendezvous) and
    return rank 0's return value; any rank's exception fails the run."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rank0.pkl")
        _run_ranks(world_size, _keep_rank0_result, fn, out_path, args, timeout_s=timeout_s)
        with open(out_path, "rb") as f:
            return pickle.load(f)


def proc_status_bytes(field: str) -> int:
    """A memory line of /proc/self/status ("VmRSS", "VmHWM", ...) in bytes; 0 where the kernel has none."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return 0


def median_seconds(fn, repeats: int, warmup: int = 1) -> float:
    """Median wall time of fn() over `repeats` calls, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)
