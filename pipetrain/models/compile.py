"""train.compile: torch.compile each transformer block in place, as torchtitan does.

Module-level compile of every block (not the whole model): a block is the unit that repeats, so blocks
of the same structure share one compiled graph (parameters are graph inputs, not constants), the
embedding, head and loss stay eager (the pipeline executor and the vocab-parallel loss run between
them), and a pipeline stage compiles only the blocks it holds. Each block is compiled with
fullgraph=True: a graph break is an error, never a silent fall back to eager pieces.

apply_compile runs last on the built stage, after everything that wraps a block's pieces: tensor
parallelism (its modules and the attn / mlp pre-hooks are traced into the graph, the collectives as
functional collectives: pipetrain.parallel.mesh.comm), gradient-accumulation fusion (inside a
compiled block linears are plain F.linear: the block's backward graph computes dW, see
pipetrain.parallel.pipeline.weight_grads.linear; under a split backward two opaque ops still defer dW
to the W action), LoRA (the adapters are parameters of the block) and
activation recomputation (the checkpointed forward is traced as one checkpoint region).
nn.Module.compile is lazy (the first call traces the block as it is then) and in place, so parameter
names, checkpoints and the pipeline chunks' references do not change; it runs last because the
attribute it gives each linear (see apply_compile) must be on the modules tensor parallelism and LoRA
leave in the block, not on the ones they replace.

The backend is inductor; PIPETRAIN_COMPILE_BACKEND (not a recipe key: tests and benchmarks only)
picks another, e.g. aot_eager, which traces exactly as inductor does but runs the eager kernels (the
CPU test matrix uses it to stay within its time budget). compile_problems says why torch.compile cannot
run on a device before any process compiles (the CLI turns it into a one-line error, exit 2).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn

from pipetrain.config import ConfigError
from pipetrain.kernels import register_compile_ops
from pipetrain.models.moe import MoE

BACKEND_ENV = "PIPETRAIN_COMPILE_BACKEND"
_SKIP_REPLAY = "skip_fwd_side_effects_in_bwd_under_checkpoint"  # torch._dynamo.config (apply_compile)
_BACKENDS = ("inductor", "aot_eager", "eager")


def compile_backend() -> str:
    """The torch.compile backend: PIPETRAIN_COMPILE_BACKEND, or inductor when unset."""
    backend = os.environ.get(BACKEND_ENV, "").strip() or "inductor"
    if backend not in _BACKENDS:
        raise ConfigError(f"{BACKEND_ENV}={backend!r} is not one of {', '.join(_BACKENDS)}; unset it for inductor")
    return backend


def check_compile(device: torch.device, backend: str) -> None:
    """Raise ConfigError when torch.compile with backend cannot run on device (compile_problems)."""
    problems = compile_problems(device, backend)
    if problems:
        raise ConfigError("; ".join(problems))


def compile_problems(device: torch.device, backend: str) -> list[str]:
    """Why torch.compile with backend cannot run on device here (empty: it can)."""
    # inductor's modules load only for a run that compiles: importing them costs every other run ~1 s
    import torch._inductor.cpp_builder
    import torch._inductor.exc
    import torch.utils._triton
    fix = "install it, or set train.compile=false"
    if not torch._dynamo.is_dynamo_supported():
        return [f"train.compile=true: torch.compile does not support this Python, got Python "
                f"{'.'.join(map(str, sys.version_info[:3]))} with torch {torch.__version__}; "
                "use a Python torch.compile supports, or set train.compile=false"]
    if backend != "inductor":
        return []
    if device.type == "cpu":
        try:
            torch._inductor.cpp_builder.get_cpp_compiler()
        except torch._inductor.exc.InvalidCxxCompiler:
            cxx = ", ".join(str(c) for c in torch._inductor.config.cpp.cxx if c)
            return [f"train.compile=true: inductor on the CPU needs a C++ compiler, got none working among "
                    f"({cxx}) (set CXX to override); {fix}"]
    elif device.type == "cuda" and not torch.utils._triton.has_triton():
        return [f"train.compile=true: inductor on CUDA needs triton, got none importable; {fix}"]
    return []


def compiled_pieces(block: nn.Module) -> dict[str, nn.Module]:
    """What a block compiles under expert parallelism ({name in the block: module}): a dense block whole; a
    mixture-of-experts block piece by piece, as torchtitan compiles its MoE blocks: the norms, the attention and
    the MoE's shared expert, each with fullgraph=True. The rest of the MoE runs eagerly between them: its
    dispatch, whose all-to-alls take uneven splits as host integers (each layer reads its row counts), which no
    graph holds, the experts' GEMMs on the rows that arrive (the grouped GEMM, or fp8's), and the router (one
    linear, nothing to fuse)."""
    mlp = block.mlp
    if not isinstance(mlp, MoE):
        return {"": block}
    pieces = {"attn_norm": block.attn_norm, "attn": block.attn, "mlp_norm": block.mlp_norm}
    if mlp.shared is not None:
        pieces["mlp.shared"] = mlp.shared
    return pieces


def apply_compile(model: nn.Module, backend: str | None = None, hooks_outside: bool = False,
                  pieces: bool = False) -> list[str]:
    """Compile each transformer block of model (a Decoder or a pipeline stage of one) in place with
    fullgraph=True; returns the compiled modules' names. Call after every other wrapping (module docstring).
    hooks_outside: compile each block's forward, not its whole call (nn.Module.compile traces the module's
    hooks too), so that hooks registered on the block run eagerly around the graph: ZeRO-3's gathers, which
    resize storage and wait on collectives (parallel/data/zero3.py). pieces (expert parallelism): a MoE block's
    pieces instead of the block (compiled_pieces); the block's own hooks then run eagerly around them too."""
    backend = backend or compile_backend()
    register_compile_ops()  # the Triton kernels' custom ops, before any trace (kernels/__init__.py)
    if any(isinstance(m, MoE) for m in model.modules()) and hasattr(torch._dynamo.config, _SKIP_REPLAY):
        # A recomputed block's forward runs again inside backward; the one side effect a block has (a MoE layer's
        # routing counts for the step, models/moe.py) must happen once, in the forward, as the eager recompute
        # skips it. Dynamo refuses the mutation inside a checkpoint region unless told not to replay it (a
        # process-wide setting; a torch without it refuses a recomputed MoE block at its first trace).
        setattr(torch._dynamo.config, _SKIP_REPLAY, True)
    names = []
    for name, block in model.layers.items():
        for module in block.modules():
            if hasattr(type(module), "deferred"):  # a WeightGradModule (models/ does not import parallel/)
                # An instance attribute from the start: the executor's deferring() sets one around a split
                # backward's F and B, and the guard of a first trace that read the class default would
                # fail then (a second compile). Inside the graph linear() never reads its value.
                module.deferred = None
        parts = compiled_pieces(block) if pieces else {"": block}
        for part_name, part in parts.items():
            if hooks_outside and part is block:
                block.forward = torch.compile(block.forward, fullgraph=True, backend=backend)
            else:
                part.compile(fullgraph=True, backend=backend)
            names.append(f"layers.{name}" + (f".{part_name}" if part_name else ""))
    return names
