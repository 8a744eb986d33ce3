"""Measure this machine into a DeviceProfile: matmul throughput, and gloo all-reduce and point-to-point
bandwidth and latency between 2 processes (torch.multiprocessing), written as JSON for --device FILE.

Bandwidth and latency come from a two-point fit: time(bytes) = latency + bytes / bandwidth, timed at a
small and a large message (median of a few repeats each); the latency is the larger of that fit and a small
all-reduce timed right after a burst of matmuls, as tensor parallelism calls it.

On CPU every figure is per core: matmuls run on one thread, as each rank does under torchrun (it sets
OMP_NUM_THREADS=1 when a node runs several processes), and `cores` records how many the node's ranks share.
`mem_bw` is timed on a gradient norm and a foreach AdamW step over 2M parameters. Given a recipe, calibrate
also times one of its transformer blocks forward and backward at one and four sequences (time = fixed +
tokens x per-token): `efficiency` becomes the fraction of the matmul peak that block reaches per token (thin
matmuls, norms, softmax and the attention kernel included), `op_overhead` the fixed part spread over the
cost model's 60 operator calls of a block's forward and backward. A 512^3 matmul alone predicted a small
model's steps 2-5x too fast.
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

from pipetrain.config import ModelConfig, Recipe
from pipetrain.models.decoder import Block
from pipetrain.parallel.pipeline import layer_costs
from pipetrain.plan.cost import OPTIMIZER_BYTES
from pipetrain.plan.devices import DEVICES, DeviceProfile

SMALL, LARGE = 4 * 1024, 16 * 2 ** 20  # message sizes in bytes


def matmul_flops(dtype: torch.dtype, n: int = 512, repeats: int = 5) -> float:
    """FLOP/s of an n x n x n matmul (median over repeats, after a warm-up)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n ** 3 / _median_time(lambda: a @ b, repeats)


def optimizer_bandwidth(numel: int = 2 ** 21, repeats: int = 5) -> float:
    """Effective memory bandwidth of the optimizer step: cost.OPTIMIZER_BYTES x numel / the seconds of a gradient
    norm and a foreach AdamW update of numel parameters in 8 tensors (as a model's several parameters)."""
    params = [torch.zeros(numel // 8, requires_grad=True) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)

    def step():
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
    return OPTIMIZER_BYTES * numel / _median_time(step, repeats)


def block_timing(cfg: ModelConfig, seq_len: int, repeats: int = 5) -> tuple[float, float]:
    """(seconds per token, fixed seconds per call) of one fp32 block of cfg forward and backward, fitted
    from one and four sequences of min(seq_len, 256) tokens (longer sequences cost the same per token
    apart from attention, which the cost model scales by FLOPs)."""
    torch.manual_seed(0)
    block = Block(cfg)
    T = min(seq_len, 256)
    times = []
    for batch in (1, 4):
        x = torch.randn(batch, T, cfg.d_model, requires_grad=True)

        def run():
            block(x).sum().backward()
        times.append(_median_time(run, repeats))
    per_token = max(times[1] - times[0], 1e-12) / (3 * T)
    return per_token, max(times[0] - T * per_token, 0.0)


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
    torch.set_num_threads(1)
    try:
        result = {}
        # tensor parallelism calls a small collective between matmuls: woken from compute, a collective costs
        # more than back to back (thread hand-off, the peer's schedule), so time it that way too
        a, w, x = torch.randn(256, 128), torch.randn(128, 384), torch.zeros(SMALL // 4)

        def compute():
            for _ in range(5):
                a @ w
        alone = _median_time(compute, 10 * repeats)
        result["allreduce_after_compute"] = _median_time(lambda: (compute(), dist.all_reduce(x)), 10 * repeats) - alone
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


def calibrate(repeats: int = 5, recipe: Recipe | None = None) -> DeviceProfile:
    """This machine as a DeviceProfile (memory: total physical memory shared by the ranks of one node; compute
    per core), fitted to recipe's block when one is given."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32 = matmul_flops(torch.float32)
        bf16 = matmul_flops(torch.bfloat16)
        overhead, efficiency, fitted = op_overhead(), 1.0, "matmul 512^3"
        mem_bw = optimizer_bandwidth()
        if recipe is not None:
            per_token, fixed = block_timing(recipe.model, recipe.train.seq_len, 4 * repeats)
            block_flops = 3 * layer_costs(recipe.model, min(recipe.train.seq_len, 256))[0]
            efficiency = min(1.0, block_flops / per_token / fp32)
            overhead = fixed / 60
            fitted = f"matmul 512^3, {recipe.model.family} block d {recipe.model.d_model} (efficiency {efficiency:.2f})"
    finally:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "comm.json")
        mp.spawn(_comm_worker, args=(os.path.join(tmp, "rdzv"), out, repeats), nprocs=2)
        with open(out) as f:
            t = json.load(f)
    p2p_bw, p2p_lat = _fit(t[f"p2p_{SMALL}"], t[f"p2p_{LARGE}"])
    # a 2-rank ring all-reduce is 2 (n-1) = 2 steps of half the buffer: per step, latency + (bytes/2) / bandwidth
    ar_bw, ar_lat = _fit(t[f"allreduce_{SMALL}"] / 2, t[f"allreduce_{LARGE}"] / 2, 0.5)
    ar_lat = max(ar_lat, t["allreduce_after_compute"] / 2)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return replace(DEVICES["cpu"], name=f"calibrated-{socket.gethostname()}", memory_bytes=float(memory),
                   bf16_flops=bf16, fp32_flops=fp32, intra_bw=min(p2p_bw, ar_bw),
                   intra_latency=max(p2p_lat, ar_lat), inter_bw=min(p2p_bw, ar_bw),
                   inter_latency=max(p2p_lat, ar_lat), efficiency=efficiency, op_overhead=overhead,
                   cores=len(os.sched_getaffinity(0)), mem_bw=mem_bw,
                   source=f"measured by python -m pipetrain.plan --calibrate on {time.strftime('%Y-%m-%d')}: "
                          f"{fitted}, one thread; gloo 2 processes")


def save_profile(profile: DeviceProfile, path: str) -> None:
    with open(path, "w") as f:
        json.dump(profile.as_dict(), f, indent=1)
