"""MFU's peak per card (metrics.peak_tflops), with torch.cuda's name stood in for: the first table key the
name holds wins, so a card whose name holds a shorter key (an L40 holds "L4", an H100 NVL "H100") must come
after its own entry. Before, an L40 was measured against an L4's 121 TFLOP/s (its MFU 1.5x too high), and an
RTX 4090, an H800 or an A800 printed no MFU."""
import pytest
import torch

from pipetrain import metrics


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H200", 989.0), ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H800", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A800-SXM4-80GB", 312.0), ("NVIDIA A10G", 70.0), ("NVIDIA A10", 125.0), ("NVIDIA L40S", 362.0),
    ("NVIDIA L40", 181.05), ("NVIDIA L4", 121.0), ("NVIDIA GeForce RTX 4090", 165.2), ("NVIDIA B200", 2250.0),
])
def test_each_card_gets_its_own_dense_bf16_peak(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert metrics.peak_tflops(torch.device("cuda", 0), None) == peak


def test_the_recipe_s_figure_wins_and_an_unknown_card_or_the_cpu_has_no_mfu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA T1000")
    assert metrics.peak_tflops(torch.device("cuda", 0), None) is None
    assert metrics.peak_tflops(torch.device("cuda", 0), 400.0) == 400.0
    assert metrics.peak_tflops(torch.device("cpu"), None) is None
