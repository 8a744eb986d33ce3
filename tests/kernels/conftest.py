"""Run the Triton kernels on CPU through the Triton interpreter.

triton.jit picks a compiled or an interpreted kernel when the decorator runs, reading TRITON_INTERPRET
then, and triton's own library functions (tl.sum's combine, ...) are decorated when triton is first
imported. So the variable must be set before anything imports triton. This conftest sets it, which is
enough when the kernel tests are the first to import triton (pipetrain.kernels imports it).

If triton was imported earlier in compiled mode (in a full run, tests/dist is collected first and
imports the model, hence pipetrain.kernels, hence triton), it cannot be switched in this process. Then
the first test marked `triton` runs all the selected `triton` tests in one fresh subprocess with
TRITON_INTERPRET=1, and each test reports its own outcome from there (a skip or a missing result
fails). The other kernel tests run here as usual.
Setting the variable has no effect outside the Triton path: CPU tensors take the torch references
unless a test sets PIPETRAIN_KERNELS=triton (always through monkeypatch, so it is undone).
"""
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

_HERE = pathlib.Path(__file__).resolve().parent
_IMPORTED_COMPILED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"

from tests.kernels.common import force_triton, poisoned  # noqa: E402,F401  (fixtures for every kernel test;
# importing it also squeezes the Triton 3.6 interpreter's indices, see tests/kernels/common.py)



def _triton_compiled_in_process() -> bool:
    if not _IMPORTED_COMPILED:
        return False
    from triton.language import standard
    from triton.runtime.jit import JITFunction  # InterpretedFunction is not a subclass
    return any(isinstance(v, JITFunction) for v in vars(standard).values())


def pytest_configure(config):
    config.addinivalue_line("markers", "triton: runs a Triton kernel (interpreted on CPU; see tests/kernels/conftest.py)")


_BATCH = {}  # nodeid -> [outcome, text] from the fallback subprocess; filled at most once per session


def _run_batch(session) -> None:
    items = [i for i in session.items if i.get_closest_marker("triton") and i.path.is_relative_to(_HERE)]
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        env = dict(os.environ, TRITON_INTERPRET="1", PIPETRAIN_BATCH_REPORT=report)
        cmd = [sys.executable, "-m", "pytest", *[i.nodeid for i in items], "-q", "-m", "slow or not slow",
               "-p", "no:cacheprovider", "-p", "tests.kernels.batch_report"]
        proc = subprocess.run(cmd, cwd=str(session.config.rootpath), env=env, capture_output=True, text=True)
        _BATCH["__log__"] = ["", f"{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}"]
        if os.path.exists(report):
            with open(report) as f:
                _BATCH.update(json.load(f))


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.get_closest_marker("triton") is None or not _triton_compiled_in_process():
        return None
    if not _BATCH:
        _run_batch(pyfuncitem.session)
    outcome, text = _BATCH.get(pyfuncitem.nodeid, ("missing", _BATCH["__log__"][1]))
    if outcome != "passed" or text != "called":
        raise AssertionError(f"{pyfuncitem.nodeid}: {outcome} in the TRITON_INTERPRET=1 subprocess (triton was "
                             f"imported compiled in this process):\n{text[-6000:]}")
    return True
