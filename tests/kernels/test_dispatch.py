"""The dispatch rule, the import boundaries of kernels/, and the reference path without triton."""
import ast
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from pipetrain.kernels.dispatch import use_triton

KERNELS_DIR = pathlib.Path(__file__).resolve().parents[2] / "kernels"


def test_use_triton_reads_the_env_var_at_call_time(monkeypatch):
    x = torch.zeros(2)
    monkeypatch.setenv("PIPETRAIN_KERNELS", "triton")
    assert use_triton(x) is True
    monkeypatch.setenv("PIPETRAIN_KERNELS", "torch")
    assert use_triton(x) is False
    monkeypatch.delenv("PIPETRAIN_KERNELS")
    assert use_triton(x) is False  # auto: CPU tensors take the reference


def test_use_triton_rejects_unknown_mode(monkeypatch):
    monkeypatch.setenv("PIPETRAIN_KERNELS", "cuda")
    with pytest.raises(ValueError, match="PIPETRAIN_KERNELS='cuda' is not one of"):
        use_triton(torch.zeros(1))


def test_forcing_triton_on_cpu_without_the_interpreter_raises(monkeypatch):
    monkeypatch.setenv("PIPETRAIN_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs TRITON_INTERPRET=1"):
        use_triton(torch.zeros(1))


def _module_level_imports(tree):
    """Import nodes that run when the module loads (not inside a def or class)."""
    found, stack = [], list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _names(node):
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return ["." * node.level + (node.module or "")]


def test_kernels_import_only_torch_triton_and_each_other():
    files = sorted(KERNELS_DIR.glob("*.py"))
    assert len(files) >= 8, f"expected the kernel modules in {KERNELS_DIR}, found {files}"
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _module_level_imports(tree):
            for name in _names(node):
                assert not name.startswith("torch.distributed"), f"{path.name}: imports {name} at module level"
                assert not (name.startswith("pipetrain") and not name.startswith("pipetrain.kernels")), \
                    f"{path.name}: imports {name}; kernels must not depend on the rest of pipetrain"
        lazy = [n for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for n in _names(node) if n.startswith("torch.distributed")]
        assert not lazy, f"{path.name}: imports torch.distributed (the vocab-parallel loss lives in pipetrain.parallel)"


_NO_TRITON = """
import os, sys
sys.modules["triton"] = None  # makes `import triton` raise ImportError
import torch
from pipetrain.kernels import cross_entropy, linear_cross_entropy, rms_norm, rope, swiglu
from pipetrain.kernels.dispatch import HAS_TRITON
assert not HAS_TRITON
x = torch.randn(3, 8, requires_grad=True)
rms_norm(x, torch.ones(8), 1e-6).sum().backward()
q = torch.randn(1, 3, 2, 8)
cos, sin = torch.ones(3, 8), torch.zeros(3, 8)
assert torch.equal(rope(q, q, cos, sin)[0], q)
swiglu(x, x).sum().backward()
cross_entropy(x, torch.tensor([1, 2, 3])).backward()
linear_cross_entropy(x, torch.randn(5, 8), torch.tensor([1, 2, 3])).backward()
os.environ["PIPETRAIN_KERNELS"] = "triton"
try:
    rms_norm(x, torch.ones(8), 1e-6)
except ValueError as e:
    assert "triton does not import" in str(e), e
else:
    raise AssertionError("forcing triton without triton must raise")
print("ok")
"""


def test_references_work_when_triton_is_not_installed():
    env = {k: v for k, v in os.environ.items() if k != "PIPETRAIN_KERNELS"}
    proc = subprocess.run([sys.executable, "-c", _NO_TRITON], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.triton
def test_eager_launches_bypass_torchs_higher_order_op(force_triton, monkeypatch):
    """In eager, a torch.library.wrap_triton launch dispatches through torch's higher-order op, which keeps one
    entry per launch in torch's kernel side table for the life of the process (and costs host time): the
    eager autograd Functions of rms_norm, rope and swiglu launch their kernels plainly, forward and backward,
    while a launcher called outside them (as train.compile's custom ops call it) still asks for the wrapper."""
    from pipetrain.kernels import dispatch, rms_norm, rope, swiglu
    from pipetrain.kernels.swiglu import swiglu_fwd
    wrapped = []
    real = dispatch._torch_wrap_triton

    def recording(kernel):
        wrapped.append(kernel)
        return real(kernel)

    monkeypatch.setattr(dispatch, "_torch_wrap_triton", recording)
    x, w = torch.randn(3, 16, requires_grad=True), torch.randn(16, requires_grad=True)
    q, k = torch.randn(1, 4, 2, 8, requires_grad=True), torch.randn(1, 4, 2, 8, requires_grad=True)
    cos, sin = torch.randn(4, 8), torch.randn(4, 8)
    gate, up = torch.randn(5, 6, requires_grad=True), torch.randn(5, 6, requires_grad=True)
    loss = rms_norm(x, w, 1e-6).sum() + sum(t.sum() for t in rope(q, k, cos, sin)) + swiglu(gate, up).sum()
    loss.backward()
    assert wrapped == [] and x.grad is not None and q.grad is not None and gate.grad is not None
    swiglu_fwd(gate.detach(), up.detach())
    assert len(wrapped) == 1
