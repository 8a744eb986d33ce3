"""Fused kernels with pure-torch references (installed as pipetrain.kernels).

Each op lives in its own module: the torch reference (`<op>_ref`, the spec and the CPU path), the
Triton kernels, an autograd.Function, and a dispatcher that picks Triton for CUDA tensors and the
reference otherwise. PIPETRAIN_KERNELS=triton|torch forces one path (see dispatch.py).
"""
from .cross_entropy import cross_entropy
from .linear_cross_entropy import linear_cross_entropy
from .rms_norm import rms_norm
from .rope import rope
from .swiglu import swiglu

__all__ = ["cross_entropy", "linear_cross_entropy", "rms_norm", "rope", "swiglu"]
