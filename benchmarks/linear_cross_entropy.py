"""Time and peak memory of the fused LM head + loss against eager PyTorch and torch.compile.

Three implementations of one forward + backward, hidden and weight requiring grad, 10% of targets ignored:
  eager    linear_cross_entropy_ref: logits = hidden @ weight.T (N, V), then F.cross_entropy on them in fp32
  compile  torch.compile of that same reference (inductor's own fusions)
  fused    pipetrain.kernels.linear_cross_entropy (Triton on CUDA, the chunked torch path on the CPU)

CUDA (the default when a GPU is present): llama-3-8B shapes in bf16, N = 4 x 2048 tokens, D 4096, V 128256
(benchmarks/kernels.py's FULL). Time: CUDA events around the call, median of --repeats after --warmup calls.
Memory: torch.cuda.max_memory_allocated during one call minus what was allocated before it (the inputs):
logits, softmax, saved tensors, gradients and the .grad buffers. Each row also gives its ratio to eager
and the issue's targets (fused time <= 1.0x eager, fused memory <= 0.3x eager).

CPU (--cpu, or no GPU): scaled down, fp32, N --tokens, D --dim, V in --vocab. Memory: each (V, impl) in a
fresh subprocess runs one warm-up call at the measured shape (compile compiles there), resets the peak RSS
(writing 5 to /proc/self/clear_refs resets VmHWM), then one call: VmHWM after minus RSS before. Time: one
subprocess per V alternates the implementations --repeats times after a warm-up call of each, so the
shared machine's load hits all alike; medians.
Shapes: N tokens, D model, V vocab.

Usage: python benchmarks/linear_cross_entropy.py [--cpu] [--repeats 10] [--warmup 3]
       [--tokens 1024] [--dim 512] [--vocab 8192 32768 131072] [--impls eager compile fused]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from pipetrain.kernels import linear_cross_entropy
from pipetrain.kernels.linear_cross_entropy import linear_cross_entropy_ref

IMPLS = ("eager", "compile", "fused")
CUDA_SHAPE = dict(N=4 * 2048, D=4096, V=128256)  # llama-3-8B; benchmarks/kernels.py FULL
TARGET_TIME, TARGET_MEMORY = 1.0, 0.3  # fused / eager, issue 34


def _impl(name: str):
    if name == "eager":
        return linear_cross_entropy_ref
    if name == "compile":
        return torch.compile(linear_cross_entropy_ref)
    return linear_cross_entropy


def _inputs(n: int, d: int, v: int, device: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=g) * d ** -0.5).to(device, dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    targets[torch.rand(n, generator=g) < 0.1] = -100
    return hidden, weight, targets.to(device)


def _step(fn, hidden, weight, targets) -> float:
    hidden.grad = weight.grad = None
    loss = fn(hidden, weight, targets)
    loss.backward()
    return loss.item()


# -- CUDA ---------------------------------------------------------------------------------------
def run_cuda(impls, repeats: int, warmup: int) -> None:
    s = CUDA_SHAPE
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, N={s['N']} D={s['D']} V={s['V']} bf16; "
          f"time = median of {repeats} forward+backward after {warmup} warm-up calls (CUDA events); "
          "memory = peak allocated during one call minus the inputs")
    print("| impl | ms | peak MiB | time / eager | memory / eager | loss |")
    print("|---|---|---|---|---|---|")
    rows = {}
    for name in impls:
        fn = _impl(name)
        hidden, weight, targets = _inputs(s["N"], s["D"], s["V"], "cuda", torch.bfloat16)
        for _ in range(warmup):
            _step(fn, hidden, weight, targets)
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _step(fn, hidden, weight, targets)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = _step(fn, hidden, weight, targets)
        torch.cuda.synchronize()
        rows[name] = (statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**20, loss)
        del hidden, weight, targets
        torch.cuda.empty_cache()
        ms, mib, loss = rows[name]
        ref = rows.get("eager", rows[name])
        print(f"| {name} | {ms:.1f} | {mib:.0f} | {ms / ref[0]:.2f} | {mib / ref[1]:.2f} | {loss:.5f} |", flush=True)
    if "eager" in rows and "fused" in rows:
        t, m = rows["fused"][0] / rows["eager"][0], rows["fused"][1] / rows["eager"][1]
        print(f"fused vs eager: time {t:.2f}x (target <= {TARGET_TIME}x: {'met' if t <= TARGET_TIME else 'MISSED'}), "
              f"memory {m:.2f}x (target <= {TARGET_MEMORY}x: {'met' if m <= TARGET_MEMORY else 'MISSED'})")


# -- CPU ----------------------------------------------------------------------------------------
def _rss_mib(field: str | None = None) -> float:
    if field is None:  # current RSS
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024  # kB


def run_memory_case(impl: str, n: int, d: int, v: int) -> dict:
    """Runs in a fresh subprocess: the peak-RSS increase of one forward + backward after a warm-up."""
    fn = _impl(impl)
    hidden, weight, targets = _inputs(n, d, v, "cpu", torch.float32)
    _step(fn, hidden, weight, targets)  # warm-up at this shape: compilation, allocator and BLAS state
    hidden.grad = weight.grad = None
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak RSS, to the current RSS
    before = _rss_mib()
    loss = _step(fn, hidden, weight, targets)
    return {"impl": impl, "loss": loss, "peak_mib": _rss_mib("VmHWM") - before}


def run_time_case(impls, n: int, d: int, v: int, repeats: int) -> dict:
    """Runs in a subprocess: the implementations alternately, median seconds per forward + backward."""
    fns = {name: _impl(name) for name in impls}
    hidden, weight, targets = _inputs(n, d, v, "cpu", torch.float32)
    times = {name: [] for name in impls}
    for fn in fns.values():
        _step(fn, hidden, weight, targets)  # warm-up (and compilation)
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            _step(fn, hidden, weight, targets)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _subprocess(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_cpu(args) -> None:
    impls = list(args.impls)
    print(f"CPU: N={args.tokens} D={args.dim} fp32, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"time = median of {args.repeats} alternating forward+backward calls; memory = peak RSS increase "
          "during one forward+backward after a warm-up, fresh process per case")
    print("| V | " + " | ".join(f"{i} MiB" for i in impls) + " | " + " | ".join(f"{i} s" for i in impls)
          + " | fused/eager memory | fused/eager time | losses equal |")
    print("|---" * (2 * len(impls) + 4) + "|")
    shape = ["--tokens", str(args.tokens), "--dim", str(args.dim), "--impls", *impls]
    for v in args.vocab:
        mem = {i: _subprocess(["--memory-case", i, str(v), *shape]) for i in impls}
        sec = _subprocess(["--time-case", str(v), "--repeats", str(args.repeats), *shape])
        losses = [m["loss"] for m in mem.values()]
        same = max(losses) - min(losses) <= 1e-5 * abs(losses[0])
        ratio = (f"{mem['fused']['peak_mib'] / mem['eager']['peak_mib']:.2f} | {sec['fused'] / sec['eager']:.2f}"
                 if "fused" in mem and "eager" in mem else "- | -")
        print(f"| {v} | " + " | ".join(f"{mem[i]['peak_mib']:.0f}" for i in impls) + " | "
              + " | ".join(f"{sec[i]:.2f}" for i in impls) + f" | {ratio} | {same} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the scaled-down CPU run even when a GPU is present")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls (CUDA 10, CPU 3)")
    parser.add_argument("--warmup", type=int, default=3, help="CUDA warm-up calls")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--vocab", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--memory-case", nargs=2, metavar=("IMPL", "VOCAB"), help=argparse.SUPPRESS)
    parser.add_argument("--time-case", type=int, metavar="VOCAB", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cpu or not torch.cuda.is_available():
        os.environ["PIPETRAIN_KERNELS"] = "torch"  # the CPU path, whatever the caller's environment says
    if args.memory_case:
        impl, v = args.memory_case
        print(json.dumps(run_memory_case(impl, args.tokens, args.dim, int(v))))
    elif args.time_case:
        print(json.dumps(run_time_case(args.impls, args.tokens, args.dim, args.time_case, args.repeats)))
    elif torch.cuda.is_available() and not args.cpu:
        run_cuda(args.impls, args.repeats or 10, args.warmup)
    else:
        args.repeats = args.repeats or 3
        run_cpu(args)


if __name__ == "__main__":
    main()
