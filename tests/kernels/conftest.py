"""Run the Triton kernels on CPU through the Triton interpreter.

triton.jit decides between a compiled and an interpreted kernel when the decorator runs, i.e. when a
kernels module is imported, reading TRITON_INTERPRET at that moment. This conftest sets it before the
kernel tests import anything. Tests in other folders (collected earlier, alphabetically) may already
have imported pipetrain.kernels through the model, with compiled kernels that cannot take CPU tensors;
those modules are re-executed here so their kernels are rebuilt in interpreter mode. reload() reuses
each module's namespace, so functions already imported elsewhere (the model's rms_norm) see the new
kernels. Setting the variable has no effect outside the Triton path: CPU tensors take the torch
references unless a test sets PIPETRAIN_KERNELS=triton (always through monkeypatch, so it is undone).
"""
import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"


def _reload_compiled_kernel_modules() -> None:
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:  # no triton: the Triton-path tests fail on their own, loudly
        return
    for name, module in sorted(sys.modules.items()):
        if module is None or not name.startswith("pipetrain.kernels."):
            continue
        kernels = [v for v in vars(module).values() if isinstance(v, (JITFunction, InterpretedFunction))]
        if any(not isinstance(k, InterpretedFunction) for k in kernels):
            importlib.reload(module)


_reload_compiled_kernel_modules()

from tests.kernels.common import force_triton, poisoned  # noqa: E402,F401  (fixtures for every kernel test)
