"""Time and peak memory of each Triton kernel (forward + backward) against torch eager and torch.compile.

Needs a CUDA GPU: on a machine without one it says so and exits 0 (no numbers are made up). For each
op, three implementations run the same forward + backward on llama-3-8B-like bf16 shapes:
  triton   the op's autograd.Function (pipetrain.kernels.<op>.<Op>Fn, the CUDA path)
  eager    the op's torch reference (<op>_ref), i.e. what unfused PyTorch does
  compile  torch.compile of that reference (inductor's own fused kernels)
Time: CUDA events around forward + backward, median of --repeats after --warmup calls.
Memory: torch.cuda.max_memory_allocated during one forward + backward, minus what was allocated before
it (the inputs), i.e. activations, saved tensors and gradients.

--check runs every case at tiny sizes on the current device (CPU: the Triton path needs
TRITON_INTERPRET=1) and only verifies that the three implementations agree: a test of this script's
wiring, not a measurement; it prints no times.

Usage: python benchmarks/kernels.py [--repeats 20] [--warmup 5] [--check]
Shapes: N tokens (B*T), D model, F ffn, H heads (Hq, Hkv), K head dim, V vocab.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from pipetrain.kernels.cross_entropy import CrossEntropyFn, cross_entropy_ref
from pipetrain.kernels.linear_cross_entropy import LinearCrossEntropyFn, linear_cross_entropy_ref
from pipetrain.kernels.rms_norm import RMSNormFn, rms_norm_ref
from pipetrain.kernels.rope import RoPEFn, rope_ref
from pipetrain.kernels.swiglu import SwiGLUFn, swiglu_ref

# llama-3-8B: D 4096, F 14336, 32 q / 8 kv heads of K 128, V 128256; a 4 x 2048-token micro-batch.
FULL = dict(B=4, T=2048, D=4096, F=14336, Hq=32, Hkv=8, K=128, V=128256)
TINY = dict(B=2, T=5, D=48, F=40, Hq=4, Hkv=2, K=8, V=300)


def _cases(s: dict, device, dtype):
    """(name, inputs needing grad, other args, triton fn, reference fn) for every op."""
    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype)

    N = s["B"] * s["T"]
    targets = torch.randint(0, s["V"], (N,), device=device)
    pos = torch.arange(s["T"], device=device, dtype=torch.float32)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, s["K"], 2, device=device, dtype=torch.float32) / s["K"]))
    emb = torch.outer(pos, inv_freq).repeat(1, 2)  # (T, K), halves duplicated
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    return [
        ("rms_norm", [rand(N, s["D"]), rand(s["D"])], [1e-5],
         lambda x, w, eps: RMSNormFn.apply(x, w, eps, x.dtype), rms_norm_ref),
        ("rope", [rand(s["B"], s["T"], s["Hq"], s["K"]), rand(s["B"], s["T"], s["Hkv"], s["K"])], [cos, sin],
         lambda q, k, c, sn: RoPEFn.apply(q, k, c, sn), rope_ref),
        ("swiglu", [rand(N, s["F"]), rand(N, s["F"])], [],
         lambda g, u: SwiGLUFn.apply(g, u), swiglu_ref),
        ("cross_entropy", [rand(N, s["V"], scale=3.0)], [targets],
         lambda x, t: CrossEntropyFn.apply(x, t, -100, 0, None), cross_entropy_ref),
        ("linear_cross_entropy", [rand(N, s["D"]), rand(s["V"], s["D"], scale=s["D"] ** -0.5)], [targets],
         lambda h, w, t: LinearCrossEntropyFn.apply(h, w, t, -100, True, True, True), linear_cross_entropy_ref),
    ]


def _fwd_bwd(fn, leaves, extra, grads_out=None):
    for x in leaves:
        x.grad = None
    out = fn(*leaves, *extra)
    outs = out if isinstance(out, tuple) else (out,)
    if grads_out is None:
        grads_out = [torch.ones_like(o) for o in outs]
    torch.autograd.backward(outs, grads_out)
    return outs, [x.grad for x in leaves]


def _measure(fn, leaves, extra, warmup: int, repeats: int):
    for _ in range(warmup):
        _fwd_bwd(fn, leaves, extra)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _fwd_bwd(fn, leaves, extra)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    for x in leaves:
        x.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _fwd_bwd(fn, leaves, extra)
    torch.cuda.synchronize()
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**20


def check(device: str) -> None:
    """Tiny sizes: the three implementations agree (no timing)."""
    for name, leaves, extra, tri, ref in _cases(TINY, device, torch.float32):
        leaves = [x.requires_grad_() for x in leaves]
        results = {impl: _fwd_bwd(fn, leaves, extra)
                   for impl, fn in (("triton", tri), ("eager", ref), ("compile", torch.compile(ref)))}
        for impl in ("triton", "compile"):
            for a, b in zip([*results[impl][0], *results[impl][1]], [*results["eager"][0], *results["eager"][1]]):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} {impl}: {m}")
        print(f"{name}: triton, eager and compile agree")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--check", action="store_true", help="tiny sizes, agreement only, any device")
    args = parser.parse_args()
    if args.check:
        check("cuda" if torch.cuda.is_available() else "cpu")
        return 0
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU (Triton kernels); none found, so nothing was measured. "
              "Run it on a CUDA machine: python benchmarks/kernels.py")
        return 0
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, shapes {FULL}, "
          f"median of {args.repeats} forward+backward")
    print("| op | impl | ms | peak MiB | time vs eager | memory vs eager |")
    print("|---|---|---|---|---|---|")
    for name, leaves, extra, tri, ref in _cases(FULL, "cuda", torch.bfloat16):
        leaves = [x.requires_grad_() for x in leaves]
        rows = {}
        for impl, fn in (("eager", ref), ("compile", torch.compile(ref)), ("triton", tri)):
            rows[impl] = _measure(fn, leaves, extra, args.warmup, args.repeats)
        for impl, (ms, mib) in rows.items():
            print(f"| {name} | {impl} | {ms:.3f} | {mib:.0f} | {ms / rows['eager'][0]:.2f} | "
                  f"{mib / max(rows['eager'][1], 1e-9):.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
