import os
import sys

# Triton reads TRITON_INTERPRET when it is first imported, and tests/dist imports it (through the
# model's kernels) before tests/kernels runs: set it here, before anything imports triton, so the
# Triton kernel tests run in-process. CPU tensors take the torch reference path either way.
os.environ.setdefault("TRITON_INTERPRET", "1")

# The tests' models are tiny: below pipetrain.models.linear.FUSE_MIN_NUMEL their linear layers would
# take plain F.linear. Fuse every weight instead, in this process and every rank it spawns, so that
# all parallel tests run the in-place gradient accumulation (plain F.linear is exercised by the
# fusion-off e2e run and tests/unit/test_linear.py).
os.environ.setdefault("PIPETRAIN_FUSE_MIN_NUMEL", "0")

# Tests import tests.harness; keep the repo root importable however pytest is launched.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
