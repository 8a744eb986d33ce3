"""Relaxed synchronisation without processes: its config and layout rules (bad input names the key and
the fix), the dp_replicate x dp_shard rank arithmetic, seeded straggler injection, SGD's state boxes."""
from __future__ import annotations

import pytest
import torch

from pipetrain.config import ConfigError, FaultsConfig, TrainConfig, build_recipe
from pipetrain.faults import Faults
from pipetrain.models import build, materialize
from pipetrain.optim import Optimizer
from pipetrain.parallel.dims import ParallelDims
from pipetrain.parallel.layout import layout_problems, resolve_dp_shard
from tests.unit.common import LLAMA, read_from

BASE = {"data": {"path": "x.txt", "tokenizer": "tok"}}


def _recipe(**sections):
    raw = {**BASE, **sections}
    return build_recipe(raw)


@pytest.mark.parametrize("parallel, key", [
    ({"dp_sync": "ssp", "staleness": -1}, "parallel.staleness"),
    ({"dp_sync": "dssp", "staleness": 1, "staleness_min": 2}, "parallel.staleness_min"),
    ({"dp_sync": "local_sgd", "sync_every": 0}, "parallel.sync_every"),
    ({"dp_sync": "diloco", "outer_momentum": 1.0}, "parallel.outer_momentum"),
    ({"dp_sync": "diloco", "outer_lr": 0}, "parallel.outer_lr"),
    ({"dp_shard": 0}, "parallel.dp_shard"),
])
def test_bad_relaxed_keys_are_config_errors_naming_the_key(parallel, key):
    with pytest.raises(ConfigError, match=key):
        _recipe(parallel=parallel)


def test_bad_optimizer_and_fault_keys_are_config_errors():
    with pytest.raises(ConfigError, match="train.momentum"):
        _recipe(train={"optimizer": "adamw", "momentum": 0.9})
    with pytest.raises(ConfigError, match="faults.slow_factor"):
        _recipe(faults={"slow_ranks": [0], "slow_factor": 0.5})
    with pytest.raises(ConfigError, match="faults.slow_prob"):
        _recipe(faults={"slow_prob": 2})
    with pytest.raises(ConfigError, match="unknown key 'faults.slow_rank'"):
        _recipe(faults={"slow_rank": [0]})


def test_layout_rules_for_replicas_and_slow_ranks():
    r = _recipe(parallel={"dp_sync": "ssp", "staleness": 1, "zero": 1})  # zero 1: dp_shard = dp, one replica
    (msg,) = layout_problems(r, 4)
    assert msg.startswith("parallel.dp_sync=ssp: needs dp_replicate") and "got 4/4=1" in msg
    assert layout_problems(_recipe(parallel={"dp_sync": "ssp", "zero": 1, "dp_shard": 2}), 4) == []
    assert layout_problems(_recipe(parallel={"dp_sync": "local_sgd"}), 4) == []  # zero 0: 4 replicas
    (msg,) = layout_problems(_recipe(parallel={"dp_shard": 3}), 4)
    assert msg.startswith("parallel.dp_shard: must divide dp=4, got 3")
    (msg,) = layout_problems(_recipe(faults={"slow_ranks": [1, 4], "slow_factor": 2}), 4)
    assert msg.startswith("faults.slow_ranks:") and "got [4]" in msg


def test_default_split_keeps_todays_behaviour():
    p = _recipe().parallel
    assert resolve_dp_shard(p, 4) == 1  # zero 0: every dp rank its own replica (bsp: the same flat all-reduce)
    assert resolve_dp_shard(_recipe(parallel={"zero": 2}).parallel, 4) == 4  # ZeRO over all of dp
    assert ParallelDims(dp=4).dp_shard == 4


def test_replicate_and_shard_groups_cover_dp():
    d = ParallelDims(dp=4, pp=2, tp=1, dp_shard=2, rank=5)  # dp rank 2 = replica 1, shard 0
    assert (d.dp_rank, d.dp_replicate_rank, d.dp_shard_rank, d.dp_replicate, d.replica_size) == (2, 1, 0, 2, 4)
    lists = d.group_rank_lists()
    assert lists["dp_shard"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lists["dp_replicate"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lists["replica"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for kind in ("dp_shard", "dp_replicate"):  # every group lies inside one dp group
        dp_groups = [set(g) for g in lists["dp"]]
        assert all(any(set(g) <= dg for dg in dp_groups) for g in lists[kind])
    assert ParallelDims(dp=4).group_rank_lists()["dp_replicate"] == []  # one replica: no extra groups


def test_straggler_pattern_is_seeded_and_follows_slow_prob():
    cfg = FaultsConfig(slow_ranks=[1], slow_factor=3.0, slow_prob=0.2, seed=7)
    a, b = Faults(cfg, 1), Faults(cfg, 1)
    pattern = [a.is_slow(s) for s in range(1, 2001)]
    assert pattern == [b.is_slow(s) for s in range(1, 2001)]
    assert 0.15 < sum(pattern) / len(pattern) < 0.25
    assert pattern != [Faults(FaultsConfig(slow_ranks=[1], slow_factor=3.0, slow_prob=0.2, seed=8), 1).is_slow(s)
                       for s in range(1, 2001)]
    assert not any(Faults(cfg, 0).is_slow(s) for s in range(1, 100))  # not a slow rank
    assert all(Faults(FaultsConfig(slow_ranks=[0], slow_factor=2.0), 0).is_slow(s) for s in range(1, 100))
    assert Faults(cfg, 0).straggle(1, 10.0) == 0.0  # no sleep off the slow ranks


def test_sgd_steps_like_torch_sgd_and_its_momentum_reloads():
    torch.manual_seed(0)
    cfg = TrainConfig(optimizer="sgd", momentum=0.9, weight_decay=0.0, lr=0.1)
    models = []
    for _ in range(2):
        m = build(LLAMA, device="meta")
        materialize(m, LLAMA, 0, torch.device("cpu"))
        models.append(m)
    opt = Optimizer(models[0], ParallelDims(), cfg)
    ref = torch.optim.SGD(models[1].parameters(), lr=0.1, momentum=0.9)
    ids = torch.randint(0, 64, (2, 8))
    for _ in range(2):
        for m, o in ((models[0], opt), (models[1], ref)):
            o.zero_grad()
            m(ids).square().mean().backward()
        opt.step(0.1)
        ref.step()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)
    items = opt.state_items()
    assert {n.split("/")[0] for n, *_ in items} == {"momentum_buffer", "step"}
    fresh = Optimizer(models[1], ParallelDims(), cfg)
    fresh.load_state_items(read_from(items))
    assert fresh.steps_taken == 2 and fresh.state_bytes() == opt.state_bytes() > 0
