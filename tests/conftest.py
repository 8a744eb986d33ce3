import os
import sys

# Triton reads TRITON_INTERPRET when it is first imported, and tests/dist imports it (through the
# model's kernels) before tests/kernels runs: set it here, before anything imports triton, so the
# Triton kernel tests run in-process. CPU tensors take the torch reference path either way.
os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests import tests.harness; keep the repo root importable however pytest is launched.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
