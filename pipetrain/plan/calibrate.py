"""Measure this machine into a DeviceProfile: matmul throughput, and gloo all-reduce and point-to-point
bandwidth and latency between 2 processes (torch.multiprocessing), written as JSON for --device FILE.
ZeRO's reduce-scatter and all-gather are timed too, as ratios to a ring's (half an all-reduce of the same
buffer): on gloo a 4 MiB reduce-scatter took 1.3x a whole all-reduce and an all-gather 0.8x, where a ring
takes 0.5x, which made ZeRO 2 look cheapest when it measured slowest.

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

Every figure is the median of `rounds` rounds (each a median of `repeats` timings): single rounds on a
2-core VM put the collective latency anywhere in 0.15-2.4 ms and the block's efficiency in 0.5-1.0 from
one run to the next, enough to reorder layouts within 20% of each other.
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
from pipetrain.parallel.mesh.comm import all_gather_async, all_reduce_, recv_, reduce_scatter_async, send_
from pipetrain.models.decoder import Block
from pipetrain.parallel.pipeline.stage import layer_costs
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


def _comm_worker(rank: int, init_file: str, out: str, repeats: int, rounds: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        results = [_comm_round(rank, repeats) for _ in range(rounds)]
        if rank == 0:
            with open(out, "w") as f:
                json.dump({key: statistics.median(r[key] for r in results) for key in results[0]}, f)
    finally:
        dist.destroy_process_group()


def _comm_round(rank: int, repeats: int) -> dict[str, float]:
    """One round of the collective timings (both ranks call it together)."""
    result, world = {}, dist.group.WORLD
    # the product's own calls (comm.py), so the timings include what they add to a raw collective
    # tensor parallelism calls a small collective between matmuls: woken from compute, a collective costs
    # more than back to back (thread hand-off, the peer's schedule), so time it that way too
    a, w, x = torch.randn(256, 128), torch.randn(128, 384), torch.zeros(SMALL // 4)

    def compute():
        for _ in range(5):
            a @ w
    alone = _median_time(compute, 10 * repeats)
    result["allreduce_after_compute"] = _median_time(lambda: (compute(), all_reduce_(x, world)), 10 * repeats) - alone
    for size in (SMALL, LARGE):
        x = torch.zeros(size // 4)
        result[f"allreduce_{size}"] = _median_time(lambda: all_reduce_(x, world), repeats)

        def ping():  # a round trip: rank 0 sends, rank 1 sends back
            if rank == 0:
                send_(x, 1, world)
                recv_(x, 1, world)
            else:
                recv_(x, 0, world)
                send_(x, 0, world)
        result[f"p2p_{size}"] = _median_time(ping, repeats) / 2
    # ZeRO's reduce-scatter and all-gather, through the same calls it makes
    half = torch.zeros(LARGE // 8)
    result["reduce_scatter"] = _median_time(lambda: reduce_scatter_async(half, x, world).wait(), repeats)
    result["all_gather"] = _median_time(lambda: all_gather_async(x, half, world).wait(), repeats)
    return result


def _fit(t_small: float, t_large: float, bytes_factor: float = 1.0) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) from times at SMALL and LARGE bytes; bytes_factor scales the bytes moved."""
    slope = max(t_large - t_small, 1e-12) / ((LARGE - SMALL) * bytes_factor)
    return 1.0 / slope, max(t_small - SMALL * bytes_factor * slope, 0.0)


def _median_rounds(fn, rounds: int):
    """fn() (a number or a tuple of numbers) run `rounds` times: the median of each figure."""
    results = [fn() for _ in range(rounds)]
    if isinstance(results[0], tuple):
        return tuple(statistics.median(r[i] for r in results) for i in range(len(results[0])))
    return statistics.median(results)


def calibrate(repeats: int = 5, recipe: Recipe | None = None, rounds: int = 5) -> DeviceProfile:
    """This machine as a DeviceProfile (memory: total physical memory shared by the ranks of one node; compute
    per core), fitted to recipe's block when one is given; every figure the median of `rounds` rounds."""
    if rounds < 1 or repeats < 1:
        raise ValueError(f"calibrate needs rounds >= 1 and repeats >= 1, got rounds={rounds}, repeats={repeats}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32 = _median_rounds(lambda: matmul_flops(torch.float32), rounds)
        bf16 = _median_rounds(lambda: matmul_flops(torch.bfloat16), rounds)
        overhead, efficiency, fitted = _median_rounds(op_overhead, rounds), 1.0, "matmul 512^3"
        mem_bw = _median_rounds(optimizer_bandwidth, rounds)
        if recipe is not None:
            per_token, fixed = _median_rounds(
                lambda: block_timing(recipe.model, recipe.train.seq_len, 4 * repeats), rounds)
            block_flops = 3 * layer_costs(recipe.model, min(recipe.train.seq_len, 256))[0]
            efficiency = min(1.0, block_flops / per_token / fp32)
            overhead = fixed / 60
            fitted = f"matmul 512^3, {recipe.model.family} block d {recipe.model.d_model} (efficiency {efficiency:.2f})"
    finally:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "comm.json")
        mp.spawn(_comm_worker, args=(os.path.join(tmp, "rdzv"), out, repeats, rounds), nprocs=2)
        with open(out) as f:
            t = json.load(f)
    p2p_bw, p2p_lat = _fit(t[f"p2p_{SMALL}"], t[f"p2p_{LARGE}"])
    # a 2-rank ring all-reduce is 2 (n-1) = 2 steps of half the buffer: per step, latency + (bytes/2) / bandwidth
    ar_bw, ar_lat = _fit(t[f"allreduce_{SMALL}"] / 2, t[f"allreduce_{LARGE}"] / 2, 0.5)
    ar_lat = max(ar_lat, t["allreduce_after_compute"] / 2)
    ring_half = t[f"allreduce_{LARGE}"] / 2  # a ring's reduce-scatter or all-gather: half its all-reduce
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return replace(DEVICES["cpu"], name=f"calibrated-{socket.gethostname()}", memory_bytes=float(memory),
                   bf16_flops=bf16, fp32_flops=fp32, intra_bw=min(p2p_bw, ar_bw),
                   intra_latency=max(p2p_lat, ar_lat), inter_bw=min(p2p_bw, ar_bw),
                   inter_latency=max(p2p_lat, ar_lat), efficiency=efficiency, op_overhead=overhead,
                   cores=len(os.sched_getaffinity(0)), mem_bw=mem_bw,
                   reduce_scatter_ratio=t["reduce_scatter"] / ring_half, all_gather_ratio=t["all_gather"] / ring_half,
                   source=f"measured by python -m pipetrain.plan --calibrate on {time.strftime('%Y-%m-%d')}: "
                          f"{fitted}, one thread; gloo 2 processes; medians of {rounds} rounds")


def save_profile(profile: DeviceProfile, path: str) -> None:
    with open(path, "w") as f:
        json.dump(profile.as_dict(), f, indent=1)
