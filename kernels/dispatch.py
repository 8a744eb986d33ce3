"""The one rule that picks a kernel's Triton path or its torch reference, read at call time.

PIPETRAIN_KERNELS=torch   always the reference (any device)
PIPETRAIN_KERNELS=triton  always Triton; CPU tensors need TRITON_INTERPRET=1 set before triton is imported
unset or "auto"           Triton for CUDA tensors when triton imports, the reference otherwise

Triton is optional: if it does not import, HAS_TRITON is False and every op runs its reference
(forcing "triton" then raises). The env var is read on every call, never cached, so tests can flip it
with monkeypatch and there is no module-level switch to reset.
"""
from __future__ import annotations

import functools
import os
import threading

import torch

try:  # triton is an optional dependency (no wheels for every platform); the references need only torch
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401
    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None
    HAS_TRITON = False

if HAS_TRITON:
    from torch.library import wrap_triton as _torch_wrap_triton

    def wrap_triton(kernel):
        """The launchers call kernels through this: torch.library.wrap_triton(kernel), a plain launch in eager
        and a kernel inductor sees when traced. Under the Triton interpreter (TRITON_INTERPRET=1) a torch whose
        wrap_triton takes compiled kernels only (2.11 refuses the interpreter's functions) gets the kernel
        itself: launched as it is, opaque to a graph around it."""
        if getattr(_DIRECT, "on", False):  # inside launches_directly: a plain launch
            return kernel
        try:
            return _torch_wrap_triton(kernel)
        except RuntimeError:
            if os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True"):
                return kernel
            raise
else:  # pragma: no cover - the launchers are never called without triton
    wrap_triton = None

_DIRECT = threading.local()  # .on: wrap_triton hands back the kernel itself (launches_directly)


def launches_directly(fn):
    """fn (an eager autograd Function's forward or backward) with its launchers' wrap_triton launches made
    plain Triton launches. In eager, a torch.library.wrap_triton launch dispatches through torch's
    higher-order op, which costs host time and keeps one entry of the launch's arguments in torch's kernel
    side table for the life of the process (never freed: about 130 a step on a 16-layer llama); torch's
    own triton_op launches its eager kernels plainly too. A trace (train.compile's custom ops) never runs
    these Functions, so inductor still sees the kernels."""
    @functools.wraps(fn)
    def direct(*args, **kwargs):
        previous = getattr(_DIRECT, "on", False)
        _DIRECT.on = True
        try:
            return fn(*args, **kwargs)
        finally:
            _DIRECT.on = previous
    return direct

ENV_VAR = "PIPETRAIN_KERNELS"
_MODES = ("auto", "torch", "triton")


def kernel_mode() -> str:
    """The value of PIPETRAIN_KERNELS ("auto" when unset), validated."""
    mode = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"{ENV_VAR}={mode!r} is not one of {', '.join(_MODES)}; unset it for auto")
    return mode


def use_triton(x: torch.Tensor) -> bool:
    """True when the op on tensor x should take its Triton path (see the module docstring)."""
    mode = kernel_mode()
    if mode == "torch":
        return False
    if mode == "auto":
        return HAS_TRITON and x.is_cuda
    if not HAS_TRITON:
        raise ValueError(f"{ENV_VAR}=triton but triton does not import here; install triton or unset {ENV_VAR}")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
        raise ValueError(f"{ENV_VAR}=triton on a {x.device.type} tensor needs TRITON_INTERPRET=1 set before "
                         "triton is imported (the Triton interpreter); or use a CUDA tensor")
    return True


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast computes in on x's device, or None where autocast is off (or cannot be: the meta
    device, which autocast does not know and refuses to be asked about)."""
    device = x.device.type
    if device == "meta" or not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


def check_dtype(where: str, x: torch.Tensor, dtypes=(torch.float32, torch.bfloat16)) -> None:
    """Raise ValueError unless x.dtype is one of dtypes (the launchers' shared check)."""
    if x.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{where}: dtype {x.dtype} is not supported; use one of {names}")
