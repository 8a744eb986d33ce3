"""The step-time model of a train.precision=fp8 run: fp8 runs under bf16 autocast (its linears in float8, at least
as fast), so the planner times its matmuls at the device's bf16 peak and its collectives on bf16 activations.

Before, cost.step_time took DeviceProfile.flops("fp8"), which fell through to the fp32 (TF32) peak: on an H100 an
fp8 step was predicted at 494.5 TFLOP/s, half what a bf16 step of the same model got, and its tp all-reduces,
cp K/V gathers and expert all-to-alls moved fp32 bytes, twice what the run sends.
"""
from __future__ import annotations

import dataclasses

import pytest

from pipetrain.config import ModelConfig, ParallelConfig, Recipe, TrainConfig
from pipetrain.models import flops_per_token
from pipetrain.plan.cost import step_time
from pipetrain.plan.devices import DEVICES

MODEL = ModelConfig(family="llama", vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=128,
                    max_seq_len=64)
H100 = dataclasses.replace(DEVICES["h100-sxm-80gb"], op_overhead=0.0, intra_latency=0.0)


def _recipe(precision: str, **parallel) -> Recipe:
    return Recipe(model=MODEL, train=TrainConfig(global_batch=8, seq_len=32, precision=precision),
                  parallel=ParallelConfig(**parallel))


def test_an_fp8_step_computes_at_the_bf16_peak():
    t = step_time(_recipe("fp8"), 1, H100, states=(0, 0, 0))
    assert t.compute == pytest.approx(8 * 32 * flops_per_token(MODEL, 32) / (989e12 * H100.efficiency), rel=1e-9)


@pytest.mark.parametrize("parallel, field", [(dict(tp=2), "tp_comm"), (dict(cp=2), "cp_comm")])
def test_an_fp8_step_s_collectives_move_bf16_activations(parallel, field):
    world = 2
    fp8 = getattr(step_time(_recipe("fp8", **parallel), world, H100, states=(0, 0, 0)), field)
    bf16 = getattr(step_time(_recipe("bf16", **parallel), world, H100, states=(0, 0, 0)), field)
    fp32 = getattr(step_time(_recipe("fp32", **parallel), world, H100, states=(0, 0, 0)), field)
    assert fp8 > 0 and fp8 == pytest.approx(bf16, rel=1e-9) and fp32 == pytest.approx(2 * bf16, rel=1e-9)
