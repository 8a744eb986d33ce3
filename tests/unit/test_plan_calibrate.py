"""--calibrate measures this machine (matmul, gloo all-reduce and p2p with 2 processes, and a recipe's block) into
a profile file that --device reads back; a CPU profile's cores are shared by the ranks of a node."""
import dataclasses

from pipetrain.config import ModelConfig, ParallelConfig, Recipe, TrainConfig
from pipetrain.plan.calibrate import calibrate, save_profile
from pipetrain.plan.cost import step_time
from pipetrain.plan.devices import DEVICES, load_profile

RECIPE = Recipe(model=ModelConfig(family="llama", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                  ffn_hidden=64, max_seq_len=32),
                train=TrainConfig(global_batch=8, seq_len=32))


def test_calibrated_profile_is_positive_and_round_trips(tmp_path):
    profile = calibrate(repeats=2, recipe=RECIPE, rounds=2)
    assert min(profile.fp32_flops, profile.bf16_flops, profile.intra_bw, profile.memory_bytes) > 0
    assert profile.intra_latency >= 0 and profile.inter_bw == profile.intra_bw
    # fitted to the recipe's block: a fraction of the matmul peak, a positive fixed cost per call
    assert 0 < profile.efficiency <= 1 and profile.op_overhead >= 0 and profile.cores >= 1
    assert "llama block d 32" in profile.source
    assert profile.reduce_scatter_ratio > 0 and profile.all_gather_ratio > 0
    path = tmp_path / "me.json"
    save_profile(profile, str(path))
    assert load_profile(str(path)) == profile


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
