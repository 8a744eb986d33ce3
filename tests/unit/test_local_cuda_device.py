"""Each process's CUDA device is its LOCAL_RANK's (torchrun's rank on the node), with torch.cuda's answers
stood in for (no GPU needed). A node launched with more processes than the GPUs they see (torchrun
--nproc-per-node 8 on a 4-GPU node, or a CUDA_VISIBLE_DEVICES that hides the others) gets one line naming
the fix from the ranks past the last GPU, which print it themselves: the rank-0 process has a GPU and
waits in init_process_group. Before, torch.cuda.set_device raised "invalid device ordinal" with a traceback
on those ranks, and the CLI left a rank-specific error to rank 0 to print, so nothing said why."""
import pytest
import torch

from pipetrain import cli
from pipetrain.config import ConfigError
from pipetrain.parallel.mesh import dims as dims_module


def _gpus(monkeypatch, count: int, local_rank: int) -> list:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(count))))
    return chosen


def test_each_process_takes_its_local_rank_s_gpu(monkeypatch):
    _gpus(monkeypatch, 4, 3)
    assert dims_module.default_device() == torch.device("cuda", 3)


def test_a_rank_past_the_node_s_last_gpu_is_refused_in_one_line_it_prints_itself(monkeypatch, capsys):
    chosen = _gpus(monkeypatch, 4, 5)
    with pytest.raises(ConfigError) as err:
        dims_module.default_device()
    message = str(err.value)
    assert message.startswith("[rank") and "LOCAL_RANK=5" in message and "sees 4" in message
    assert "--nproc-per-node" in message and "\n" not in message
    monkeypatch.setenv("RANK", "13")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setattr(cli.dist, "is_initialized", lambda: False)
    with pytest.raises(ConfigError, match="LOCAL_RANK=5"):
        cli._init_distributed(16)
    assert chosen == []  # refused before torch.cuda.set_device, which raised a CUDA error
