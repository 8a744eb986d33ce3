"""The Triton kernels as torch.compile custom ops: one registrar that every kernel module declares itself to.

A kernel module describes its op once, as data (CompileOp: the launchers, whose type annotations give the
ops' schemas, the fake
implementations, which inputs and outputs its backward needs) and calls declare() at import, which costs
nothing. register_all() (pipetrain.kernels.register_compile_ops, called by apply_compile before any trace)
then registers every declared op as pipetrain::<name> and pipetrain::<name>_backward with
torch.library.triton_op, the backward op as the forward's autograd formula. Registering is deferred
because a triton_op imports torch._inductor, ~1.5 s that every process of a run that does not compile
would pay. forward_op(name) is what a module's dispatcher calls inside a trace; it raises if the op was
never registered (a trace that reached a kernel before register_all).

Why both the launchers and the ops exist: kernels/__init__.py.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from .dispatch import HAS_TRITON


@dataclass(frozen=True)
class CompileOp:
    """One kernel's custom op. forward(*inputs) and backward(*grads, *saved) are the launchers, annotated
    (torch.library infers each op's schema from them); fake / backward_fake give output
    shapes without launching. The backward op takes the first num_grads upstream gradients, then the
    inputs at saved_inputs and the outputs at saved_outputs, and returns the gradients of the first
    inputs (the rest, tables and scalars, get None)."""

    name: str
    forward: Callable
    backward: Callable
    fake: Callable
    backward_fake: Callable
    num_grads: int
    saved_inputs: tuple[int, ...]
    saved_outputs: tuple[int, ...] = ()


# Module state on purpose: kernel modules declare their ops at import, register_all registers them once
# per process (torch.library refuses a second registration of a name).
_DECLARED: dict[str, CompileOp] = {}
_REGISTERED: dict[str, tuple] = {}  # name -> (forward op, backward op)


def declare(spec: CompileOp) -> CompileOp:
    """Record spec for register_all; returns it. Called once by each kernel module at import."""
    _DECLARED[spec.name] = spec
    return spec


def declared() -> list[str]:
    """Names of every declared op."""
    return sorted(_DECLARED)


def register_all() -> None:
    """Register every declared op not yet registered (a no-op without triton)."""
    if not HAS_TRITON:
        return
    for name, spec in _DECLARED.items():
        if name not in _REGISTERED:
            _REGISTERED[name] = _register(spec)


def forward_op(name: str):
    """The registered pipetrain::<name> op (dispatchers call it while torch.compile traces)."""
    if name not in _REGISTERED:
        raise RuntimeError(f"pipetrain::{name} is not registered; call pipetrain.kernels.register_compile_ops() "
                           "before torch.compile traces a kernel (apply_compile does)")
    return _REGISTERED[name][0]


def backward_op(name: str):
    """The registered pipetrain::<name>_backward op."""
    forward_op(name)  # the same error when unregistered
    return _REGISTERED[name][1]


def _register(spec: CompileOp) -> tuple:
    op = torch.library.triton_op(f"pipetrain::{spec.name}", spec.forward, mutates_args=())
    bwd = torch.library.triton_op(f"pipetrain::{spec.name}_backward", spec.backward, mutates_args=())
    op.register_fake(spec.fake)
    bwd.register_fake(spec.backward_fake)
    num_inputs = len(inspect.signature(spec.forward).parameters)

    def setup_context(ctx, inputs, output):
        outputs = output if isinstance(output, tuple) else (output,)
        ctx.save_for_backward(*(inputs[i] for i in spec.saved_inputs), *(outputs[i] for i in spec.saved_outputs))

    def backward(ctx, *grads):
        got = bwd(*grads[:spec.num_grads], *ctx.saved_tensors)
        got = got if isinstance(got, tuple) else (got,)
        return (*got, *(None,) * (num_inputs - len(got)))

    op.register_autograd(backward, setup_context=setup_context)
    return op, bwd
