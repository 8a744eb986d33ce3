"""Relaxed synchronisation without processes: its config and layout rules (bad input names the key and
the fix), the dp_replicate x dp_shard rank arithmetic, seeded straggler injection, SGD's state boxes, and
which updates DSSP applies under scripted exchanges and clock."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipetrain.config import ConfigError, FaultsConfig, ParallelConfig, TrainConfig, build_recipe
from pipetrain.faults import Faults
from pipetrain.models import build, materialize
from pipetrain.optim.build import Optimizer
from pipetrain.parallel.replicas import stale, wrapped
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.mesh.rules import layout_problems, parallel_problems, resolve_dp_shard
from pipetrain.stopping import resume_point
from tests.unit.common import LLAMA, read_from

BASE = {"data": {"path": "x.txt", "tokenizer": "tok"}}


def _recipe(**sections):
    raw = {**BASE, **sections}
    return build_recipe(raw, rules=parallel_problems)


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


# ---- which updates DSSP applies, scripted: fake exchanges and clock, no processes ----

class _Work:
    """A scripted exchange: complete when the test says so; wait() on an incomplete one is where a real
    run would block until the slowest replica arrives (recorded)."""

    def __init__(self):
        self.done, self.blocked = False, False

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> None:
        self.blocked = self.blocked or not self.done
        self.done = True


class _Inner:
    """The wrapped optimizer: one parameter with a gradient; records the lr of every update."""

    def __init__(self, steps_taken: int = 0):
        self.model = torch.nn.Linear(2, 1, bias=False)
        self.model.weight.grad = torch.zeros(1, 2)
        self.lrs, self.steps_taken = [], steps_taken

    def clip_grad_norm(self, max_norm: float) -> float:
        return 0.0

    def step(self, lr: float) -> None:
        self.lrs.append(lr)

    def load_state_items(self, read) -> None:
        pass


def _relaxed(monkeypatch, mode="dssp", staleness=3, staleness_min=1, steps_taken=0):
    """A StaleSyncOptimizer of replica 0 of 2 whose exchanges are _Works: the peer replica reaches clock c
    at time c (1 s per step) and publishes that beside its gradient; the other rank of this replica
    decides replica_counts[clock] (max-agreed)."""
    works, replica_counts, clock, now = {}, {}, [], []

    def all_reduce_async(x, group):
        if x.dtype == torch.float64:  # the clock metadata (time at this clock, mean step time) of each replica,
            x[0] = torch.tensor([now[-1], 1.0], dtype=torch.float64)  # on the scripted clock
            x[1] = torch.tensor([float(clock[-1]), 1.0], dtype=torch.float64)
            return works[clock[-1]]   # exchanged beside the clock's gradient: complete with it
        works[clock[-1]] = _Work()
        return works[clock[-1]]

    def all_reduce_max_(t, group):
        t.fill_(max(float(t), replica_counts.get(clock[-1], 0)))
    monkeypatch.setattr(stale, "all_reduce_async", all_reduce_async)
    monkeypatch.setattr(stale, "all_reduce_max_", all_reduce_max_)
    monkeypatch.setattr(stale, "group_device", lambda group: torch.device("cpu"))  # the groups are names here
    dims = SimpleNamespace(dp_replicate=2, dp_replicate_group="replicate", dp_replicate_rank=0, dp_shard_rank=0,
                           replica_group="replica", device=torch.device("cpu"))
    pcfg = ParallelConfig(dp_sync=mode, staleness=staleness, staleness_min=staleness_min)
    opt = stale.StaleSyncOptimizer(_Inner(steps_taken), dims, pcfg, TrainConfig())

    def step(c: int, t: float) -> dict:
        clock.append(c)
        now.append(t)
        opt.now = lambda: t
        _, _, stats = opt.sync_step(c, lambda k: k / 100, 0.0, lambda norm: None, compute_s=1.0)
        return stats
    return opt, works, replica_counts, step


def test_dssp_applies_complete_and_soon_complete_updates_within_the_bounds(monkeypatch):
    opt, works, replica_counts, step = _relaxed(monkeypatch)  # staleness 3, staleness_min 1, half a step 0.5 s
    assert step(1, 0.1)["applied"] == []   # clock 1 is inside the lower bound
    assert step(2, 0.3)["applied"] == []   # clock 1 incomplete, and no clock published yet: wait unknown
    works[1].done = True
    assert step(3, 1.2)["applied"] == [1]  # complete: applied early; clock 2 incomplete, wait still unknown
    assert not works[1].blocked
    # published: the peer reached clock 1 at t=1 at 1 s per step; at t=1.8 clock 2 is 0.2 s away (< 0.5 s)
    assert step(4, 1.8)["applied"] == [2] and works[2].blocked
    assert not works[3].blocked            # clock 3 is 1.2 s away: left for later
    replica_counts[5] = 1                  # clock 3 is 0.9 s away, but the replica's other rank saw it
    assert step(5, 2.1)["applied"] == [3]  # soon: the replica agrees on the max
    assert step(6, 3.1)["applied"] == []   # clock 4: 0.9 s away
    assert step(7, 3.7)["applied"] == [4] and works[4].blocked  # the upper bound: clock 7 - 3 waits whatever
    assert opt.wrapped.lrs == [0.01, 0.02, 0.03, 0.04]  # each update with its own clock's learning rate
    assert opt._predicted_wait(5) == pytest.approx(5 - (4 + 3.7 - 4))  # from clock 4's publication


def test_clock_lag_counts_from_the_resumed_step(monkeypatch):
    opt, works, _, step = _relaxed(monkeypatch, mode="ssp", staleness=2, staleness_min=0, steps_taken=10)
    opt.load_state_items(lambda *a: None)  # a checkpoint of step 10 holds every update up to clock 10
    assert step(11, 0.0)["clock_lag"] == 1
    assert step(12, 0.0)["clock_lag"] == 2


def test_ssp_with_staleness_0_takes_bsps_path():
    for mode in ("ssp", "dssp"):
        pcfg = ParallelConfig(dp_sync=mode, staleness=0)
        assert wrapped.sync_mode(pcfg) == "bsp"
        assert not wrapped.needs_replica_sync(pcfg, SimpleNamespace(dp_replicate=2, dp_shard=1), zero=0)
    assert wrapped.sync_mode(ParallelConfig(dp_sync="ssp", staleness=1)) == "ssp"


def test_a_stop_without_a_save_names_what_there_is_to_resume_from(tmp_path):
    root = tmp_path / "checkpoints"
    assert "no checkpoint was saved before" in resume_point(str(root))  # a stop before any save
    root.mkdir()
    (root / "latest").write_text("step-00000040\n")
    assert resume_point(str(root)).startswith("checkpoints/latest still names step-00000040")
    assert "no checkpoint was saved before" in resume_point(None)  # --eval-only: no checkpoint folder
