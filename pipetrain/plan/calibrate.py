"""Measure this machine into a DeviceProfile: matmul throughput, and gloo all-reduce and point-to-point
bandwidth and latency between 2 processes (torch.multiprocessing), written as JSON for --device FILE.

Bandwidth and latency come from a two-point fit: time(bytes) = latency + bytes / bandwidth, timed at a
small and a large message (median of a few repeats each).
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipetrain.plan.devices import DEVICES, DeviceProfile

SMALL, LARGE = 4 * 1024, 16 * 2 ** 20  # message sizes in bytes


def matmul_flops(dtype: torch.dtype, n: int = 512, repeats: int = 5) -> float:
    """FLOP/s of an n x n x n matmul (median over repeats, after a warm-up)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times)


def op_overhead(repeats: int = 200) -> float:
    """Seconds per eager operator call: a chain of tiny matmuls forward and backward, per op (3 per matmul)."""
    x = torch.randn(4, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)

    def run():
        y = x
        for _ in range(10):
            y = y @ w
        y.sum().backward()
    return _median_time(run, repeats) / 30


def _median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _comm_worker(rank: int, init_file: str, out: str, repeats: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        result = {}
        for size in (SMALL, LARGE):
            x = torch.zeros(size // 4)
            result[f"allreduce_{size}"] = _median_time(lambda: dist.all_reduce(x), repeats)

            def ping():  # a round trip: rank 0 sends, rank 1 sends back
                if rank == 0:
                    dist.send(x, 1)
                    dist.recv(x, 1)
                else:
                    dist.recv(x, 0)
                    dist.send(x, 0)
            result[f"p2p_{size}"] = _median_time(ping, repeats) / 2
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _fit(t_small: float, t_large: float, bytes_factor: float = 1.0) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) from times at SMALL and LARGE bytes; bytes_factor scales the bytes moved."""
    slope = max(t_large - t_small, 1e-12) / ((LARGE - SMALL) * bytes_factor)
    return 1.0 / slope, max(t_small - SMALL * bytes_factor * slope, 0.0)


def calibrate(repeats: int = 5) -> DeviceProfile:
    """This machine as a DeviceProfile (memory: total physical memory shared by the ranks of one node)."""
    fp32 = matmul_flops(torch.float32)
    bf16 = matmul_flops(torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "comm.json")
        mp.spawn(_comm_worker, args=(os.path.join(tmp, "rdzv"), out, repeats), nprocs=2)
        with open(out) as f:
            t = json.load(f)
    p2p_bw, p2p_lat = _fit(t[f"p2p_{SMALL}"], t[f"p2p_{LARGE}"])
    # a 2-rank ring all-reduce is 2 (n-1) = 2 steps of half the buffer: per step, latency + (bytes/2) / bandwidth
    ar_bw, ar_lat = _fit(t[f"allreduce_{SMALL}"] / 2, t[f"allreduce_{LARGE}"] / 2, 0.5)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return replace(DEVICES["cpu"], name=f"calibrated-{socket.gethostname()}", memory_bytes=float(memory),
                   bf16_flops=bf16, fp32_flops=fp32, intra_bw=min(p2p_bw, ar_bw),
                   intra_latency=max(p2p_lat, ar_lat), inter_bw=min(p2p_bw, ar_bw),
                   inter_latency=max(p2p_lat, ar_lat), efficiency=1.0, op_overhead=op_overhead(),
                   source=f"measured by python -m pipetrain.plan --calibrate on {time.strftime('%Y-%m-%d')}: "
                          "matmul 512^3; gloo 2 processes")


def save_profile(profile: DeviceProfile, path: str) -> None:
    with open(path, "w") as f:
        json.dump(profile.as_dict(), f, indent=1)
