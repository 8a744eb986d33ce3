"""train.precision against the card (build.precision_problem), with torch.cuda's answers stood in for: bf16
and fp8 on a card before Ampere (a T4, a V100) are refused in one line naming fp32. Before, the first Triton
kernel failed in ptxas ("Feature '.bf16' requires .target sm_80 or higher") with a traceback."""
import pytest
import torch

from pipetrain.build import precision_problem
from pipetrain.config import ConfigError
from pipetrain.parallel.mesh.dims import ParallelDims
from tests.unit.common import LLAMA, build_trainer


@pytest.fixture
def card(monkeypatch):
    def use(name: str, capability: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    return use


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_bfloat16_before_ampere_is_refused_naming_fp32(card, precision):
    card("Tesla T4", (7, 5))
    problem = precision_problem(torch.device("cuda", 0), precision)
    assert problem.startswith(f"train.precision={precision}:") and "Tesla T4 (sm_75)" in problem
    assert problem.endswith("use train.precision=fp32") and "\n" not in problem


def test_fp32_anywhere_and_bf16_from_ampere_on_run(card):
    card("Tesla V100-SXM2-32GB", (7, 0))
    assert precision_problem(torch.device("cuda", 0), "fp32") is None
    card("NVIDIA A100-SXM4-80GB", (8, 0))
    assert precision_problem(torch.device("cuda", 0), "bf16") is None
    assert precision_problem(torch.device("cpu"), "bf16") is None


def test_a_run_on_such_a_card_stops_before_building_anything(card, tmp_path):
    card("Tesla T4", (7, 5))
    with pytest.raises(ConfigError, match=r"train.precision=bf16: .*Tesla T4 \(sm_75\)"):
        build_trainer(LLAMA, str(tmp_path), ParallelDims(device=torch.device("cuda", 0)), precision="bf16")
