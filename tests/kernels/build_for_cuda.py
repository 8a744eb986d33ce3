"""Builds, on the CPU, every Triton kernel that a torch.compile custom op launches, for a Hopper GPU (sm_90:
the H100 and H200), with its arguments typed as inductor types them and as Triton's own launcher does.

Why: the interpreter (how the CPU suite runs the kernels) is lenient about types, and the eager GPU launch
types a Python float as fp32, but inductor's wrapper around a user-defined Triton kernel types it fp64 on
CUDA (torch/_inductor/codegen/triton_utils.py, signature_of). An fp64 `eps` made RMSNorm's fp32 math fp64,
and its bf16 rounding (a bitcast of 32-bit words) did not build: train.compile failed on the H200 for
every RMSNorm model under bf16. triton.compile needs no GPU for a named target (ptxas ships with triton).
A build also fails if its Triton IR computes in fp64 (an fp64 argument may only be converted to fp32):
the eager launch computes in fp32, and so must the compiled one.

It also builds the fp8 casts (kernels/fp8_quant.py), which only eager runs launch (a trace takes their
torch reference), in both float8 formats and in their byte-copy mode.

Each op's forward and backward launchers run with small CPU tensors in every dtype combination training
uses, while JITFunction.run is replaced by a build of the kernel for that signature. Prints one line per
signature, `built ...` or `failed ...: error`, and `ops: ...`; exits 1 if a build failed.
Run in a process without TRITON_INTERPRET (tests/kernels/test_build_for_cuda.py).
"""
from __future__ import annotations

import os
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("build_for_cuda.py: unset TRITON_INTERPRET (the interpreter's kernels cannot be compiled)")
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-cache-"))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from pipetrain.kernels import compile_ops  # noqa: E402
from pipetrain.kernels import fp8_quant  # noqa: E402
from pipetrain.kernels.fp8_quant import fp8_amax, fp8_cast  # noqa: E402
from pipetrain.kernels.rms_norm import rms_norm_bwd, rms_norm_fwd  # noqa: E402
from pipetrain.kernels.rope import rope_bwd, rope_fwd  # noqa: E402
from pipetrain.kernels.swiglu import swiglu_bwd, swiglu_fwd  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
_POINTEE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
            torch.int64: "i64", torch.int32: "i32", torch.uint8: "u8"}
# A Python float as each launcher types it: inductor (CUDA has fp64) and Triton's own JIT launch
FLOAT_TYPES = {"inductor": "fp64", "triton": "fp32"}


def arg_type(value, float_type: str) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _POINTEE[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return float_type
    raise TypeError(f"no Triton type for {type(value).__name__} {value!r}")


RESULTS: dict[tuple, str] = {}
OPS: set[str] = set()  # the kernel modules whose kernels were launched (pipetrain.kernels.<op>)


def build_instead_of_launch(self, *args, grid, warmup, **kwargs):
    """JITFunction.run's stand-in: compile the kernel for TARGET with each launcher's typing; launch nothing."""
    bound = dict(zip(self.arg_names, args))
    bound.update((k, v) for k, v in kwargs.items() if k in self.arg_names)
    options = {k: v for k, v in kwargs.items() if k not in self.arg_names}  # num_warps, num_stages
    constexprs = {p.name: bound[p.name] for p in self.params if p.is_constexpr}
    OPS.add(self.fn.__module__.rpartition(".")[2])
    for launcher, float_type in FLOAT_TYPES.items():
        signature = {p.name: "constexpr" if p.is_constexpr else arg_type(bound[p.name], float_type)
                     for p in self.params}
        key = (self.fn.__name__, launcher, tuple(signature.items()), repr(sorted(constexprs.items())))
        if key in RESULTS:
            continue
        try:
            kernel = triton.compile(ASTSource(self, signature, constexprs), target=TARGET, options=options)
            fp64 = [line.strip() for line in kernel.asm["ttir"].splitlines() if "f64" in line
                    and "tt.func" not in line and not ("arith.truncf" in line and "f64 to f32" in line)]
            RESULTS[key] = f"failed: fp64 arithmetic: {fp64[0][:300]}" if fp64 else "built"
        except Exception as e:  # noqa: BLE001  (every failure is reported, with its kernel and signature)
            RESULTS[key] = f"failed: {type(e).__name__}: {' '.join(str(e).split())[:400]}"


def run_launchers() -> None:
    """Every op's forward and backward launcher, in each dtype combination a run uses."""
    torch.manual_seed(0)
    f32, b16 = torch.float32, torch.bfloat16
    # RMSNorm: fp32 model; bf16 model; bf16 autocast (fp32 residual and weight, bf16 output and dy); qwen3's
    # q/k norms under autocast (bf16 q and k from the linears, fp32 weight)
    for x_dtype, w_dtype, out_dtype in ((f32, f32, f32), (b16, b16, b16), (f32, f32, b16), (b16, f32, b16)):
        x, w = torch.randn(6, 40, dtype=x_dtype), torch.randn(40, dtype=w_dtype)
        y, rstd = rms_norm_fwd(x, w, 1e-6, out_dtype)
        rms_norm_bwd(torch.randn_like(y), x, w, rstd)
    for dtype in (f32, b16):
        q, k = torch.randn(2, 5, 4, 8, dtype=dtype), torch.randn(2, 5, 2, 8, dtype=dtype)
        cos, sin = torch.randn(5, 8, dtype=dtype), torch.randn(5, 8, dtype=dtype)
        rope_bwd(*rope_fwd(q, k, cos, sin), cos, sin)
        gate, up = torch.randn(3, 7, 6, dtype=dtype), torch.randn(3, 7, 6, dtype=dtype)
        swiglu_bwd(swiglu_fwd(gate, up), gate, up)
    # fp8: activations (bf16) and weights (fp32) in either format, both layouts; a float8 tensor's transpose
    for dtype in (f32, b16):
        x = torch.randn(70, 40, dtype=dtype)
        fp8_amax(x)
        for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
            for columns in (False, True):
                fp8_cast(x, torch.ones(1), fmt, rows=True, columns=columns)
    for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
        fp8_cast(torch.zeros(70, 40, dtype=fmt), torch.ones(1), fmt, rows=False, columns=True)
    # sizes past 2**31 elements, which Triton's launcher types i64
    x, big = torch.randn(70, 40, dtype=b16), 2**31 + 64
    fp8_quant._amax_kernel[(1,)](x, torch.empty(1), big, BLOCK=fp8_quant._AMAX_BLOCK, num_warps=8)
    out = torch.empty(70, 40, dtype=torch.uint8)
    fp8_quant._cast_kernel[(1, 1)](x, torch.ones(1), torch.empty(()), out, out, big, 64, E5M2=False, FMAX=448.0,
                                   EPS=fp8_quant.AMAX_EPS, ROWS=True, COLUMNS=True, COPY=False, BM=64, BD=64,
                                   num_warps=4)


def main() -> int:
    JITFunction.run = build_instead_of_launch
    run_launchers()
    for (kernel, launcher, signature, constexprs), outcome in sorted(RESULTS.items()):
        print(f"{outcome.split(':')[0]} {kernel} ({launcher}) {dict(signature)} {constexprs}{outcome[6:]}")
    print("ops:", " ".join(sorted(OPS)), "| declared:", " ".join(compile_ops.declared()))
    return 1 if any(v != "built" for v in RESULTS.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
