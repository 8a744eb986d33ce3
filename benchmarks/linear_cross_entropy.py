"""Peak memory and time of linear_cross_entropy against an unfused LM head + F.cross_entropy, on CPU.

For each vocabulary size (8k, 32k, 128k) and each implementation, one forward + backward of
  unfused: logits = hidden @ weight.T (N, V); F.cross_entropy(logits, targets); backward
  fused:   pipetrain.kernels.linear_cross_entropy(hidden, weight, targets); backward (the chunked torch
           path, which is what CPU tensors take)
on fp32 hidden (N, D) and weight (V, D), both requiring grad, with 10% of the targets ignored.

Memory: every (vocab, implementation) case runs in a fresh subprocess. After the inputs exist and a
tiny warm-up call has loaded the math libraries, the process records its peak RSS
(resource.getrusage ru_maxrss) and its current RSS (/proc/self/statm); it runs the measured call once
and reads the peak RSS again (and fails if the call did not raise the setup's peak). Peak minus the
RSS before the call is the extra memory the call needed at its peak: logits, softmax, gradients and the
.grad buffers (allocated during the call, for both implementations alike).
Time: one more subprocess per vocabulary alternates the two implementations --repeats times after a
warm-up call of each, so the shared machine's load hits both alike; medians and their ratio.
Shapes: N tokens, D model, V vocab.

Usage: python benchmarks/linear_cross_entropy.py [--tokens 1024] [--dim 512] [--repeats 3]
       [--vocab 8192 32768 131072]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from pipetrain.kernels import linear_cross_entropy

IMPLS = ("unfused", "fused")


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _inputs(n: int, d: int, v: int):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=g).requires_grad_()
    weight = torch.randn(v, d, generator=g).mul_(d ** -0.5).requires_grad_()  # in place: no setup transient
    targets = torch.randint(0, v, (n,), generator=g)
    targets[torch.rand(n, generator=g) < 0.1] = -100
    return hidden, weight, targets


def _step(impl: str, hidden, weight, targets) -> float:
    hidden.grad = weight.grad = None
    if impl == "unfused":
        loss = F.cross_entropy(hidden @ weight.t(), targets)
    else:
        loss = linear_cross_entropy(hidden, weight, targets)
    loss.backward()
    return loss.item()


def run_memory_case(impl: str, n: int, d: int, v: int) -> dict:
    """Runs in a fresh subprocess: the peak-RSS increase of one forward + backward."""
    _step(impl, *_inputs(8, d, 64))  # load BLAS / allocator state at negligible size
    hidden, weight, targets = _inputs(n, d, v)
    setup_peak, before = _peak_rss_mib(), _current_rss_mib()
    loss = _step(impl, hidden, weight, targets)
    peak = _peak_rss_mib()
    if peak <= setup_peak:
        raise RuntimeError(f"{impl} V={v}: the call's peak RSS did not exceed the setup's ({setup_peak:.0f} MiB); "
                           "the measurement would be meaningless")
    return {"impl": impl, "loss": loss, "peak_mib": peak - before}


def run_time_case(n: int, d: int, v: int, repeats: int) -> dict:
    """Runs in a subprocess: both implementations alternately, median seconds per forward + backward."""
    hidden, weight, targets = _inputs(n, d, v)
    times = {impl: [] for impl in IMPLS}
    for impl in IMPLS:
        _step(impl, hidden, weight, targets)  # warm-up
    for _ in range(repeats):
        for impl in IMPLS:
            start = time.perf_counter()
            _step(impl, hidden, weight, targets)
            times[impl].append(time.perf_counter() - start)
    return {impl: statistics.median(t) for impl, t in times.items()}


def _subprocess(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--memory-case", nargs=2, metavar=("IMPL", "VOCAB"), help=argparse.SUPPRESS)
    parser.add_argument("--time-case", type=int, metavar="VOCAB", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ["PIPETRAIN_KERNELS"] = "torch"  # the CPU path, whatever the caller's environment says
    if args.memory_case:
        impl, v = args.memory_case
        print(json.dumps(run_memory_case(impl, args.tokens, args.dim, int(v))))
        return
    if args.time_case:
        print(json.dumps(run_time_case(args.tokens, args.dim, args.time_case, args.repeats)))
        return

    print(f"N={args.tokens} D={args.dim} fp32, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"time = median of {args.repeats} alternating forward+backward calls; "
          "memory = peak RSS increase during one forward+backward, fresh process per case")
    print("| V | unfused peak MiB | fused peak MiB | memory fused/unfused | unfused s | fused s | time fused/unfused | loss equal |")
    print("|---|---|---|---|---|---|---|---|")
    shape = ["--tokens", str(args.tokens), "--dim", str(args.dim)]
    for v in args.vocab:
        mem = {impl: _subprocess(["--memory-case", impl, str(v), *shape]) for impl in IMPLS}
        sec = _subprocess(["--time-case", str(v), "--repeats", str(args.repeats), *shape])
        u, f = mem["unfused"], mem["fused"]
        same = abs(u["loss"] - f["loss"]) <= 1e-5 * abs(u["loss"])
        print(f"| {v} | {u['peak_mib']:.0f} | {f['peak_mib']:.0f} | {f['peak_mib'] / u['peak_mib']:.2f} | "
              f"{sec['unfused']:.2f} | {sec['fused']:.2f} | {sec['fused'] / sec['unfused']:.2f} | {same} |",
              flush=True)


if __name__ == "__main__":
    main()
