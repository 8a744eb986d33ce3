"""Every Triton kernel a torch.compile custom op launches builds for a Hopper GPU, with its arguments typed as
inductor types them (a Python float is fp64 there) and as Triton's launcher does, and computes in fp32 either
way: built on the CPU by tests/kernels/build_for_cuda.py (why: its docstring). The interpreter the other
kernel tests use accepted an fp64 eps that made train.compile fail on the H200."""
import os
import re
import subprocess
import sys

import pytest

from pipetrain.kernels.compile_ops import declared
from pipetrain.kernels.dispatch import HAS_TRITON
from tests.e2e.common import ROOT

KERNELS = {"fp8_quant": ("_amax_kernel", "_cast_kernel"),  # eager only: not a compile op
           "rms_norm": ("_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel"),
           "rope": ("_rope_fwd_kernel", "_rope_bwd_kernel"),
           "swiglu": ("_swiglu_fwd_kernel", "_swiglu_bwd_kernel")}


@pytest.mark.skipif(not HAS_TRITON, reason="triton does not import here")
def test_every_compile_op_kernel_builds_for_hopper_with_inductors_argument_types():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.build_for_cuda"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert f"ops: {' '.join(sorted(KERNELS))} | declared: {' '.join(declared())}" in proc.stdout
    built = set(re.findall(r"^built (\w+) \((\w+)\)", proc.stdout, re.M))
    assert built == {(k, launcher) for ks in KERNELS.values() for k in ks for launcher in ("inductor", "triton")}
    assert "failed" not in proc.stdout
