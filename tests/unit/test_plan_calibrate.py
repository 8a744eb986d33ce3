"""--calibrate measures this machine (matmul, gloo all-reduce and p2p with 2 processes, and a recipe's block) into
a profile file that --device reads back; a CPU profile's cores are shared by the ranks of a node."""
import dataclasses
import json
import math

import pytest
import torch

import pipetrain.plan.calibrate as calibrate_mod
from pipetrain.config import ModelConfig, ParallelConfig, Recipe, TrainConfig
from pipetrain.parallel.pipeline.stage import layer_costs
from pipetrain.plan.calibrate import LARGE, SMALL, calibrate, save_profile
from pipetrain.plan.cost import step_time
from pipetrain.plan.devices import DEVICES, load_profile

RECIPE = Recipe(model=ModelConfig(family="llama", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                  ffn_hidden=64, max_seq_len=32),
                train=TrainConfig(global_batch=8, seq_len=32))


class _Script:
    """Scripted measurements: each call returns the next value of its list (one per round)."""

    def __init__(self, values):
        self.values = list(values)

    def __call__(self, *args, **kwargs):
        return self.values.pop(0)


def _comm_times(p2p_lat, p2p_bw, ar_lat, ar_bw, after_compute, rs_ratio, ag_ratio) -> dict:
    """What the 2-process comm worker would write for these link figures (a 2-rank ring all-reduce is two
    steps of half the buffer)."""
    t = {"allreduce_after_compute": after_compute}
    for size in (SMALL, LARGE):
        t[f"p2p_{size}"] = p2p_lat + size / p2p_bw
        t[f"allreduce_{size}"] = 2 * (ar_lat + size / 2 / ar_bw)
    t["reduce_scatter"] = rs_ratio * t[f"allreduce_{LARGE}"] / 2
    t["all_gather"] = ag_ratio * t[f"allreduce_{LARGE}"] / 2
    return t


def test_calibration_fits_the_scripted_timings_and_round_trips(tmp_path, monkeypatch):
    """With every timing scripted, the profile holds the medians of the rounds and the figures fitted from
    them: link bandwidth and latency from the two-point fit (the slower link, the all-reduce latency raised
    to the after-compute one), the block's efficiency and fixed cost, the ZeRO collectives' ratios."""
    fp32 = 4e9
    block_flops = 3 * layer_costs(RECIPE.model, RECIPE.train.seq_len)[0]
    per_token, fixed = block_flops / (0.25 * fp32), 6e-4  # the block reaches a quarter of the matmul peak
    monkeypatch.setattr(calibrate_mod, "matmul_flops",
                        lambda dtype: {torch.float32: flops32, torch.bfloat16: flops16}[dtype]())
    flops32, flops16 = _Script([5e9, fp32, 1e9]), _Script([8e9, 9e9, 7e9])  # medians 4e9 and 8e9
    monkeypatch.setattr(calibrate_mod, "op_overhead", _Script([1e-6, 3e-6, 2e-6]))
    monkeypatch.setattr(calibrate_mod, "optimizer_bandwidth", _Script([3e9, 1e9, 2e9]))
    monkeypatch.setattr(calibrate_mod, "block_timing",
                        _Script([(per_token, fixed), (2 * per_token, 2 * fixed), (per_token / 2, fixed / 2)]))
    times = _comm_times(p2p_lat=1e-4, p2p_bw=2e9, ar_lat=2e-4, ar_bw=5e8, after_compute=1e-3, rs_ratio=2.6,
                        ag_ratio=1.6)

    def spawn(fn, args, nprocs):  # the comm worker's output file, written without processes
        assert fn is calibrate_mod._comm_worker and nprocs == 2
        with open(args[1], "w") as f:
            json.dump(times, f)
    monkeypatch.setattr(calibrate_mod.mp, "spawn", spawn)

    profile = calibrate(repeats=2, recipe=RECIPE, rounds=3)
    fitted = dict(fp32_flops=4e9, bf16_flops=8e9, mem_bw=2e9, efficiency=0.25, op_overhead=fixed / 60,
                  intra_bw=5e8, inter_bw=5e8,  # the all-reduce's 5e8 B/s, slower than p2p's 2e9
                  intra_latency=5e-4, inter_latency=5e-4,  # after compute: 1 ms per all-reduce, 2 ring steps
                  reduce_scatter_ratio=2.6, all_gather_ratio=1.6)
    for key, value in fitted.items():
        assert getattr(profile, key) == pytest.approx(value, rel=1e-9), key
    assert "llama block d 32 (efficiency 0.25)" in profile.source
    path = tmp_path / "me.json"
    save_profile(profile, str(path))
    assert load_profile(str(path)) == profile  # every figure back exactly, none clamped or rounded


def test_calibration_measures_this_machine():
    """The real measurement path (matmuls, the block, 2 gloo processes) runs and yields usable figures;
    what it computes from them is checked with scripted timings above."""
    profile = calibrate(repeats=1, recipe=RECIPE, rounds=1)
    figures = (profile.fp32_flops, profile.bf16_flops, profile.intra_bw, profile.mem_bw, profile.efficiency,
               profile.reduce_scatter_ratio, profile.all_gather_ratio)
    assert all(math.isfinite(x) and x > 0 for x in figures), figures
    assert profile.cores >= 1 and profile.intra_latency >= 0


def test_ranks_beyond_the_cores_share_them():
    cpu = dataclasses.replace(DEVICES["cpu"], cores=2)
    recipe = dataclasses.replace(RECIPE, parallel=ParallelConfig(tp=1, pp=1))
    alone = step_time(recipe, 2, cpu, ranks_per_node=2)      # dp 2 on 2 cores
    crowded = step_time(recipe, 2, cpu, ranks_per_node=4)    # the same ranks, 4 to a node of 2 cores
    gpu_like = step_time(recipe, 2, dataclasses.replace(cpu, cores=0), ranks_per_node=4)
    assert crowded.compute == 2 * alone.compute
    assert gpu_like.compute == alone.compute


def test_an_idle_pipeline_rank_lends_its_core():
    """pp 4 with one microbatch idles 3/4 of the step on devices of their own; 4 ranks on 2 cores take at least
    twice a rank's busy time anyway, so the bubble shrinks into that bound."""
    recipe = dataclasses.replace(RECIPE, model=dataclasses.replace(RECIPE.model, n_layers=4),
                                 parallel=ParallelConfig(pp=4, microbatches=1))
    own = step_time(recipe, 4, DEVICES["cpu"], ranks_per_node=4)
    shared = step_time(recipe, 4, dataclasses.replace(DEVICES["cpu"], cores=2), ranks_per_node=4)
    assert own.bubble_fraction > 0.5
    assert shared.bubble < own.bubble
    assert shared.total >= 2 * (own.compute + own.tp_comm)


def test_the_optimizer_step_costs_the_parameters_a_rank_updates():
    base = dataclasses.replace(RECIPE, parallel=ParallelConfig(zero=0))
    zero1 = dataclasses.replace(RECIPE, parallel=ParallelConfig(zero=1))
    full, shard = step_time(base, 2, DEVICES["cpu"]), step_time(zero1, 2, DEVICES["cpu"])
    assert full.optimizer > 0 and abs(shard.optimizer / full.optimizer - 0.5) < 0.05


def test_zero_collectives_cost_what_the_profile_measured_them_at():
    """On NCCL's rings ZeRO 2's reduce-scatter + all-gather cost one all-reduce; where the backend's reduce-scatter
    is slower (gloo: 2.5x a ring's), ZeRO 2 must rank below plain data parallelism."""
    cpu = dataclasses.replace(DEVICES["cpu"], cores=2)
    slow_rs = dataclasses.replace(cpu, reduce_scatter_ratio=2.5, all_gather_ratio=1.5)

    def dp_time(zero, profile):
        return step_time(dataclasses.replace(RECIPE, parallel=ParallelConfig(zero=zero)), 2, profile).dp_comm
    assert abs(dp_time(2, cpu) - dp_time(0, cpu)) < 1e-12
    assert abs(dp_time(2, slow_rs) - 2 * dp_time(0, cpu)) < 1e-12  # (2.5 + 1.5) / 2 all-reduces
    assert dp_time(1, slow_rs) == dp_time(0, cpu) + 0.75 * dp_time(0, cpu)  # all-reduce + 1.5 x half of one


def test_a_rank_peaks_in_its_largest_phase():
    """forward (activations, the recomputed block, gradients of earlier microbatches, buffers), end of backward
    (full gradients, buffers) or optimizer step (reduced gradients, AdamW's temporaries)."""
    from pipetrain.plan.memory import RankMemory, rank_memory
    states = dict(params=4, grads=2, optim=8)
    assert RankMemory(0, **states, activations=9, comm=1, step_temp=4, full_grads=4).total == 12 + 10
    assert RankMemory(0, **states, activations=1, comm=1, step_temp=4, full_grads=4).total == 12 + 6
    assert RankMemory(0, **states, activations=1, comm=4, step_temp=1, full_grads=4).total == 12 + 8
    one = rank_memory(dataclasses.replace(RECIPE, parallel=ParallelConfig(microbatches=1)), 1)[0]
    four = rank_memory(dataclasses.replace(RECIPE, parallel=ParallelConfig(microbatches=4)), 1)[0]
    assert one.grads_live == 0 and four.grads_live == four.params  # the first microbatch's gradients stay
    full = rank_memory(dataclasses.replace(RECIPE, parallel=ParallelConfig(recompute="full")), 1)[0]
    none = rank_memory(RECIPE, 1)[0]
    assert none.recompute_temp == 0 and 0 < full.recompute_temp < none.activations
