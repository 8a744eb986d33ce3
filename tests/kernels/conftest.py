"""Run the Triton kernels on CPU through the Triton interpreter.

triton.jit picks a compiled or an interpreted kernel when the decorator runs, reading TRITON_INTERPRET
then, and triton's own library functions (tl.sum's combine, ...) are decorated when triton is first
imported. So the variable must be set before anything imports triton. This conftest sets it, which is
enough when the kernel tests are the first to import triton (pipetrain.kernels imports it).

If triton was imported earlier in compiled mode (say a test collected before this folder imported the
model, or used torch.compile), it cannot be switched in this process. Tests marked `triton` then run
each in a fresh subprocess with TRITON_INTERPRET=1 (slower, same assertions); the others run here.
Setting the variable has no effect outside the Triton path: CPU tensors take the torch references
unless a test sets PIPETRAIN_KERNELS=triton (always through monkeypatch, so it is undone).
"""
import os
import re
import subprocess
import sys

import pytest

_IMPORTED_COMPILED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"

from tests.kernels.common import force_triton, poisoned  # noqa: E402,F401  (fixtures for every kernel test)


def _triton_compiled_in_process() -> bool:
    if not _IMPORTED_COMPILED:
        return False
    from triton.language import standard
    from triton.runtime.jit import JITFunction  # InterpretedFunction is not a subclass
    return any(isinstance(v, JITFunction) for v in vars(standard).values())


def pytest_configure(config):
    config.addinivalue_line("markers", "triton: runs a Triton kernel (interpreted on CPU; see tests/kernels/conftest.py)")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.get_closest_marker("triton") is None or not _triton_compiled_in_process():
        return None
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", pyfuncitem.nodeid, "-q", "-m", "slow or not slow", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, cwd=str(pyfuncitem.config.rootpath), env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not re.search(r"\b1 passed\b", proc.stdout):  # a skip is not a pass
        raise AssertionError(f"{pyfuncitem.nodeid} failed in its TRITON_INTERPRET=1 subprocess (triton was "
                             f"imported compiled in this process):\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}")
    return True
