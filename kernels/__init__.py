"""Fused kernels with pure-torch references (installed as pipetrain.kernels).

Each op lives in its own module: the torch reference (`<op>_ref`, the spec and the CPU path), the
Triton kernels, an autograd.Function, and a dispatcher that picks Triton for CUDA tensors and the
reference otherwise. PIPETRAIN_KERNELS=triton|torch forces one path (see dispatch.py).

The Triton path has two wrappers around the same launchers: eager calls go through the autograd.Function
(no operator dispatch per call: its launches bypass wrap_triton's higher-order op, dispatch.launches_directly),
and code being traced by torch.compile (train.compile) calls the
custom ops pipetrain::<op> and pipetrain::<op>_backward (torch.library.triton_op with the backward op
registered as its autograd formula; each op module declares its op to compile_ops.py, the one registrar),
whose kernels launch through wrap_triton, so inductor sees them as
Triton kernels in its graph, schedules around them and derives their fake (meta) implementation by running
the launcher on fake tensors. The torch reference stays the CPU path, compiled or not.

fp8_quant (float8 amaxes and casts for train.precision=fp8) is not differentiable and has no custom op: eager
CUDA calls launch its kernels, and a trace takes its torch reference, which inductor fuses into the ops that
produce the tensor it quantises.
"""
from .compile_ops import register_all
from .cross_entropy import cross_entropy
from .linear_cross_entropy import linear_cross_entropy
from .rms_norm import rms_norm
from .rope import rope
from .swiglu import swiglu

__all__ = ["cross_entropy", "linear_cross_entropy", "register_compile_ops", "rms_norm", "rope", "swiglu"]


def register_compile_ops() -> None:
    """Register the custom ops torch.compile traces (a no-op without triton, or the second time). Only runs
    that compile call it (pipetrain.models.compile.apply_compile), before tracing: registering imports
    torch._inductor, ~1 s that every other process would pay at import."""
    register_all()  # every op an imported module declared (rms_norm, rope, swiglu: imported above)
