"""Run a function on several gloo processes on CPU, as STYLE.md section 6 describes.

Rendezvous is through a file in a temporary directory: no ports, no retries. Any rank's exception
fails the test (mp.spawn re-raises it with the rank's traceback).
"""
from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# fp32 tolerances used across the parallel tests, each with the reason it is needed.
EXACT_FP32 = dict(rtol=1e-5, atol=1e-6)  # pp / dp: same ops, only gradient-accumulation order differs
TP_FP32 = dict(rtol=1e-4, atol=1e-5)     # tp splits reductions over D and F, changing summation order


def _worker(rank: int, world_size: int, init_file: str, fn, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=300))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args) -> None:
    """Run fn(rank, world_size, *args) on world_size gloo processes; any rank's exception fails the test."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world_size, os.path.join(tmp, "rdzv"), fn, args), nprocs=world_size)
