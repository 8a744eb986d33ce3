import os
import sys

import pytest

# Triton reads TRITON_INTERPRET when it is first imported, and tests/dist imports it (through the
# model's kernels) before tests/kernels runs: set it here, before anything imports triton, so the
# Triton kernel tests run in-process. CPU tensors take the torch reference path either way.
# (The `gpu` tests that need compiled Triton run it in a subprocess without the variable.)
os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`-n N`: benchmarks/gpu_session.sh runs the suite so on a 16-core GPU machine) N workers share
# the cores, and each one's torch, and every process its tests start, would take a thread per core (N times as
# many threads as cores, OpenMP's spinning ones among them), and inductor a pool of compile processes per worker.
# Each worker gets its share of the cores instead, and compiles in its own process. A value set by hand stays.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
if _XDIST_WORKERS:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)  # Linux
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores // _XDIST_WORKERS)))
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# Tests import tests.harness; keep the repo root importable however pytest is launched.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402  (after TRITON_INTERPRET: torch may import triton)

if _XDIST_WORKERS:  # a plugin may have imported torch before this file set OMP_NUM_THREADS
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# The real answers, read before the session hides the GPU (below). Asking initialises CUDA in this process
# with the real CUDA_VISIBLE_DEVICES, so hiding it afterwards only affects the processes tests start.
HAS_CUDA = torch.cuda.is_available()
_REAL_IS_AVAILABLE = torch.cuda.is_available
_REAL_VISIBLE_DEVICES = os.environ.get("CUDA_VISIBLE_DEVICES")


def pytest_collection_modifyitems(config, items):
    """Without CUDA the `gpu` tests skip, saying why. With CUDA they run first (before any CPU test has
    started a process or touched CUDA under the hidden GPU)."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not HAS_CUDA:
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)"))
        return
    items[:] = gpu + [item for item in items if not item.get_closest_marker("gpu")]


@pytest.fixture(scope="session", autouse=True)
def _cpu_by_default():
    """Tests are about CPU behaviour unless marked `gpu`: on a CUDA machine they see no GPU, in this process
    (torch.cuda.is_available() is False, so ParallelDims picks the CPU) and in every process they start
    (CUDA_VISIBLE_DEVICES is empty: train.py, torchrun and the gloo workers of tests/harness.py stay on the
    CPU and never put several ranks on one GPU). Session-wide, so module and session fixtures see it too."""
    patch = pytest.MonkeyPatch()
    patch.setattr(torch.cuda, "is_available", lambda: False)
    patch.setenv("CUDA_VISIBLE_DEVICES", "")
    yield
    patch.undo()


@pytest.fixture(autouse=True)
def _gpu_tests_see_the_gpu(request, monkeypatch):
    """A `gpu` test (and the function-scoped fixtures it uses) gets the real CUDA back."""
    if request.node.get_closest_marker("gpu") is None:
        return
    monkeypatch.setattr(torch.cuda, "is_available", _REAL_IS_AVAILABLE)
    if _REAL_VISIBLE_DEVICES is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", _REAL_VISIBLE_DEVICES)
