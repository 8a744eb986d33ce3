"""parallel.auto's device profile at launch (plan.auto.launch_profile) on CUDA cards, with torch.cuda's
answers stood in for (no GPU needed): a card the table knows plans with its figures, capped at the memory
the card reports (a MIG slice, a smaller variant); one it does not know is refused with the fix. Before,
any card whose name held none of the table's keys (an H200, a B200, an A10) planned as the CPU placeholder:
host RAM as its memory, 50 GFLOP/s, gloo's staged collectives and the torch references."""
import types

import pytest
import torch

from pipetrain.config import ConfigError
from pipetrain.plan import auto
from pipetrain.plan.devices import DEVICES, GB


def _card(monkeypatch, name: str, total_memory: float) -> None:
    monkeypatch.delenv("PIPETRAIN_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index=None: types.SimpleNamespace(total_memory=int(total_memory)))


@pytest.mark.parametrize("name,total,entry", [
    ("NVIDIA H200", 150.1e9, "h200-141gb"),
    ("NVIDIA GH200 480GB", 102.0e9, "h200-141gb"),  # the Grace Hopper's GPU, at the memory it reports
    ("NVIDIA H100 80GB HBM3", 85.0e9, "h100-sxm-80gb"),
    ("NVIDIA H100 PCIe", 85.0e9, "h100-pcie-80gb"),
    ("NVIDIA L40S", 48.3e9, "l40s"),  # not the L4 its name starts with
    ("NVIDIA L4", 24.0e9, "l4"),
    ("NVIDIA A100-SXM4-40GB", 42.5e9, "a100-40gb"),
    ("NVIDIA A100-SXM4-80GB", 85.1e9, "a100-80gb"),
])
def test_a_known_card_plans_with_its_profile_capped_at_the_memory_it_reports(monkeypatch, name, total, entry):
    _card(monkeypatch, name, total)
    profile = auto.launch_profile(8)
    table = DEVICES[entry]
    assert (profile.name, profile.bf16_flops, profile.intra_bw) == (entry, table.bf16_flops, table.intra_bw)
    assert profile.memory_bytes == min(table.memory_bytes, total)
    assert profile.device_type == "cuda" and not profile.staged_collectives


def test_a_mig_slice_plans_with_its_own_memory(monkeypatch):
    _card(monkeypatch, "NVIDIA H100 80GB HBM3 MIG 1g.10gb", 10.7e9)
    profile = auto.launch_profile(1)
    assert profile.name == "h100-sxm-80gb" and profile.memory_bytes == 10.7e9


def test_an_unknown_card_is_refused_with_the_fix(monkeypatch):
    _card(monkeypatch, "NVIDIA A10", 24.0e9)
    with pytest.raises(ConfigError) as err:
        auto.launch_profile(2)
    message = str(err.value)
    assert "'NVIDIA A10'" in message and "PIPETRAIN_DEVICE" in message and "h200-141gb" in message
    assert "\n" not in message


def test_pipetrain_device_still_overrides_the_card(monkeypatch):
    _card(monkeypatch, "NVIDIA A10", 24.0e9)
    monkeypatch.setenv("PIPETRAIN_DEVICE", "l4")
    assert auto.launch_profile(2) == DEVICES["l4"]


def test_the_h200_entry_is_the_datasheet_s():
    h200 = DEVICES["h200-141gb"]
    assert (h200.memory_bytes, h200.bf16_flops, h200.mem_bw) == (141 * GB, 989e12, 4.8e12)
