"""parallel.ep with no processes: its layout rules (one line each), the ep / expert-dp groups of the mesh,
the boxes an ep rank's experts have in the global tensors, and the planner's memory and all-to-all time."""
from __future__ import annotations

import dataclasses

import torch

from pipetrain.config import DataConfig, ParallelConfig, Recipe, TrainConfig
from pipetrain.models import build, param_layout
from pipetrain.parallel.expert.dispatch import _local_experts
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.mesh.rules import layout_problems, parallel_problems
from pipetrain.plan.cost import step_time
from pipetrain.plan.devices import DEVICES, load_profile
from pipetrain.plan.memory import model_state_bytes
from pipetrain.plan.search import search
from tests.dist.test_moe import MOE
from tests.unit.common import LLAMA

HUGE = dataclasses.replace(DEVICES["cpu"], memory_bytes=1e15)


def _recipe(model=MOE, **parallel) -> Recipe:
    return Recipe(model=model, data=DataConfig(path="x", tokenizer="y"),
                  parallel=ParallelConfig(**parallel), train=TrainConfig(seq_len=16, global_batch=8))


def test_ep_refusals_are_one_line_each():
    assert not parallel_problems(_recipe(ep=2)) and not layout_problems(_recipe(ep=2), 4)
    assert parallel_problems(_recipe(LLAMA, ep=2)) == [
        "parallel.ep: shards experts, but model.num_experts=0 (a dense model), got 2; set parallel.ep=1 or pick an "
        "MoE family"]
    [odd] = parallel_problems(_recipe(ep=3))
    assert odd.startswith("parallel.ep: must divide model.num_experts=4") and "got 3" in odd
    assert not parallel_problems(_recipe(ep=2, zero=3))  # experts gathered over expert-dp (parallel/expert/zero.py)
    [dynamic] = [p for p in parallel_problems(_recipe(ep=2, dynamic_batch=True)) if "parallel.ep=2" in p]
    assert dynamic.startswith("parallel.dynamic_batch: with parallel.ep=2 needs every ep group inside one replica")
    assert not parallel_problems(_recipe(ep=2, dynamic_batch=True, dp_shard=2, zero=1))  # tests/dist/test_expert_hsdp
    # HSDP: an ep group inside one replica (parallel/expert/zero.py), so ep divides dp_shard
    assert not parallel_problems(_recipe(ep=2, dp_shard=2, zero=1))
    assert not parallel_problems(_recipe(ep=2, dp_shard=4, zero=3))
    [split] = parallel_problems(_recipe(ep=2, dp_shard=3, zero=1))
    assert split.startswith("parallel.dp_shard: must be a multiple of parallel.ep=2") and "got 3" in split, split
    [not_dp] = layout_problems(_recipe(ep=4), 2)
    assert not_dp.startswith("parallel.ep: must divide dp=2") and "got 4" in not_dp


def test_under_hsdp_the_expert_shards_are_one_replicas_holders_of_the_same_experts():
    """dp 8 = 2 replicas x dp_shard 4, ep 2: dp rank = replica * 4 + shard, ep rank = shard % 2. ZeRO shards a
    rank's experts over the 2 ranks of its replica with its ep rank, never over the other replica's."""
    d = ParallelDims(dp=8, ep=2, dp_shard=4, rank=6)
    assert (d.dp_replicate, d.dp_shard_rank, d.ep_rank, d.expert_dp_shard) == (2, 2, 0, 2)
    lists = d.group_rank_lists()
    assert lists["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # inside a replica: (0..3) and (4..7)
    assert lists["expert_dp_shard"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lists["dp_replicate"] == [[0, 4], [1, 5], [2, 6], [3, 7]]  # the same rows: replica 1's peer
    assert d.expert_zero_shard[:2] == (2, 1)  # rank 6: the second of [4, 6]
    one = ParallelDims(dp=8, ep=2, rank=6)  # one replica: expert-dp, as before
    assert one.expert_zero_shard[:2] == (4, 3) and one.group_rank_lists()["expert_dp_shard"] == []
    assert ParallelDims(dp=4, ep=2, dp_shard=2).group_rank_lists()["expert_dp_shard"] == []  # one holder a replica


def test_ep_groups_are_consecutive_dp_ranks_and_expert_dp_their_strided_peers():
    lists = ParallelDims(dp=4, tp=2, ep=2).group_rank_lists()
    assert lists["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]  # same tp coordinate, dp ranks (0, 1) and (2, 3)
    assert lists["expert_dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]  # dp ranks (0, 2) and (1, 3): same experts
    d = ParallelDims(dp=4, ep=2, rank=3)
    assert (d.ep_rank, d.expert_dp, d.expert_dp_rank) == (1, 2, 1)
    assert ParallelDims(dp=2, ep=2).group_rank_lists()["ep"] == []  # ep == dp: the dp group itself


def test_under_cp_an_ep_group_stays_in_one_cp_coordinate_and_experts_reduce_over_expert_dp_x_cp():
    """(dp 4, cp 2): rank = dp_rank * 2 + cp_rank. Each cp rank dispatches its own tokens over its own ep group;
    the ranks holding the same experts are expert-dp x cp (expert-dp-major, like dp_cp), ZeRO's expert shards."""
    lists = ParallelDims(dp=4, cp=2, ep=2).group_rank_lists()
    assert lists["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]  # dp ranks (0, 1) and (2, 3), one cp coordinate each
    assert lists["expert_dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lists["expert_dp_cp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]  # ep rank 0's experts, ep rank 1's
    d = ParallelDims(dp=4, cp=2, ep=2, rank=5)  # dp 2, cp 1: ep rank 0, expert-dp rank 1
    assert d.expert_zero_shard[:2] == (4, 3) and lists["expert_dp_cp"][0][3] == 5
    # ep == dp: the cp group holds the same experts; cp == 1: the expert-dp group; neither needs a group of its own
    assert ParallelDims(dp=2, cp=2, ep=2).group_rank_lists()["expert_dp_cp"] == []
    assert ParallelDims(dp=4, ep=2).group_rank_lists()["expert_dp_cp"] == []


def test_local_experts_are_row_boxes_of_the_global_tensors():
    model = build(MOE, device="meta")
    experts = model.layers["0"].mlp.experts
    local = _local_experts(experts, ParallelDims(dp=2, ep=2, rank=1))
    model.layers["0"].mlp.experts = local
    shape, slices = param_layout(model)["layers.0.mlp.experts.down"]
    assert shape == tuple(experts.down.shape) and slices[0] == slice(2, 4) and local.down.shape[0] == 2


def test_planner_holds_experts_over_ep_and_times_the_all_to_all():
    one, two = _recipe(), _recipe(ep=2, dp=2)
    E, F, D = MOE.num_experts, MOE.expert_ffn, MOE.d_model
    experts = MOE.n_layers * 3 * E * F * D * 4  # bytes of every expert weight
    assert model_state_bytes(one, 2, 0)[0] - model_state_bytes(two, 2, 0)[0] == experts // 2
    zero = dataclasses.replace(two, parallel=ParallelConfig(ep=2, dp=4, zero=1))  # expert-dp 2: half the rows
    plain = dataclasses.replace(two, parallel=ParallelConfig(ep=1, dp=4, zero=1))
    assert model_state_bytes(plain, 4, 0)[2] - model_state_bytes(zero, 4, 0)[2] == 0  # E/2 experts over 2 = E over 4
    profile = load_profile("cpu")
    assert step_time(two, 2, profile).ep_comm > 0 and step_time(_recipe(dp=2), 2, profile).ep_comm == 0
    torch.testing.assert_close(step_time(one, 1, profile).ep_comm, 0.0)


def test_planner_may_put_ep_under_cp_only_where_ep_divides_dp():
    """ep borrows its ranks from dp, never from cp: on 4 ranks at ep 2 the search keeps cp 2 x dp 2 and drops
    every layout whose dp is 1; each cp rank all-to-alls only its own T/cp tokens."""
    recipe = _recipe(ep=2)
    found = {(p.layout["dp"], p.layout["cp"]) for p in search(recipe, 4, HUGE).plans}
    assert (2, 2) in found and all(dp % 2 == 0 for dp, _ in found), found
    cp2 = dataclasses.replace(recipe, parallel=ParallelConfig(ep=2, dp=2, cp=2))
    dp2 = dataclasses.replace(recipe, parallel=ParallelConfig(ep=2, dp=2))
    profile = load_profile("cpu")
    assert step_time(cp2, 4, profile).ep_comm < step_time(dp2, 2, profile).ep_comm  # half the tokens per rank
