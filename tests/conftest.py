import os
import sys

import pytest

# Triton reads TRITON_INTERPRET when it is first imported, and tests/dist imports it (through the
# model's kernels) before tests/kernels runs: set it here, before anything imports triton, so the
# Triton kernel tests run in-process. CPU tensors take the torch reference path either way.
# (The `gpu` tests that need compiled Triton run it in a subprocess without the variable.)
os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests import tests.harness; keep the repo root importable however pytest is launched.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402  (after TRITON_INTERPRET: torch may import triton)

# The real answer, read once before any test hides the GPU (below).
HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    """Without CUDA the `gpu` tests skip, saying why. With CUDA they run first: CUDA initialises once per
    process, reading CUDA_VISIBLE_DEVICES then, and the CPU tests hide the GPU through that variable."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not HAS_CUDA:
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)"))
        return
    items[:] = gpu + [item for item in items if not item.get_closest_marker("gpu")]


@pytest.fixture(autouse=True)
def _cpu_unless_gpu(request, monkeypatch):
    """Every test not marked `gpu` is about CPU behaviour: on a CUDA machine it sees no GPU, in this process
    (torch.cuda.is_available() is False, so ParallelDims picks the CPU) and in every process it starts
    (CUDA_VISIBLE_DEVICES is empty: train.py, torchrun and the gloo workers of tests/harness.py stay on
    the CPU, and never put several ranks on one GPU)."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
