"""On a CUDA machine a test that is not marked `gpu` still runs on the CPU (tests/conftest.py): it sees no
GPU in its own process, and every process it starts inherits an empty CUDA_VISIBLE_DEVICES."""
import os

import torch

from pipetrain.parallel.mesh.dims import ParallelDims, default_device


def test_a_cpu_test_sees_no_gpu_here_or_in_the_processes_it_starts():
    assert torch.cuda.is_available() is False
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == ""
    assert default_device().type == "cpu" and ParallelDims.from_degrees().device.type == "cpu"
