"""pipetrain.parallel.replicas.failover without processes: where a torchrun sits among the replica groups, what its layout
check sees, every launch problem at once, and sync_step's arithmetic against a stand-in for torchft's Manager
(all groups live, one missing, an uncommitted step, and a trainer logging a redone step once)."""
import importlib.util
import json
import os
import types

import pytest
import torch

from pipetrain.config import ParallelConfig, Recipe, TrainConfig, build_recipe
from pipetrain.data import Loader
from pipetrain.optim.build import Optimizer
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.mesh.rules import parallel_problems
from pipetrain.parallel.replicas.failover import FaultTolerantOptimizer, Replica, replica_from_env
from tests.unit.common import LLAMA, build_trainer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                reason='torchft is not installed: pip install "pipetrain[torchft]"')
ENV = {"TORCHFT_LIGHTHOUSE": "http://localhost:29510", "REPLICA_GROUP_ID": "1"}


def _recipe(**parallel):
    return build_recipe({"model": {"d_model": 64, "n_layers": 4, "n_heads": 4},
                         "data": {"path": "x", "tokenizer": "y"}, "train": {"global_batch": 8},
                         "parallel": {"fault_tolerance": "torchft", **parallel}})


def test_a_torchrun_is_one_replica_group_reading_its_slice_of_the_global_batch():
    replica, problems = replica_from_env(_recipe(dp=4, pp=2), world_size=4, env=ENV)  # 2 groups of 2 dp x 2 pp
    assert problems == [] and replica == Replica(replica_id=1, num_replicas=2, dp_shard=2)
    local = replica.local_recipe(_recipe(dp=4, pp=2))
    assert (local.parallel.dp, local.parallel.dp_shard, local.train.global_batch) == (2, 2, 4)
    assert replica.output_dir("runs/x").endswith("replica-1")


def test_launch_problems_are_reported_together():
    _, problems = replica_from_env(_recipe(dp=3, dp_shard=1), world_size=2, env={"REPLICA_GROUP_ID": "x"})
    text = " | ".join(problems)
    assert "TORCHFT_LIGHTHOUSE is not set" in text
    assert "parallel.dp_shard: must equal the dp ranks of one replica group" in text
    assert "parallel.dp=3: must be a multiple of the dp ranks of one replica group (2" in text
    assert "REPLICA_GROUP_ID: must be a replica group index in [0, 1)" in text
    _, problems = replica_from_env(_recipe(dp=2), world_size=1, env=dict(ENV, REPLICA_GROUP_ID="2"))
    assert problems == ["REPLICA_GROUP_ID: must be a replica group index in [0, 2) (parallel.dp=2 / 1 dp rank(s) "
                        "per group), got '2'"]


class _Work:
    def wait(self):
        return True


class _Manager:
    """torchft's Manager as sync_step sees it: the other live groups' sums arrive in allreduce."""

    def __init__(self, peers, commit=True):
        self.peers, self.commit, self.calls = peers, commit, 0

    def allreduce(self, tensor, reduce_op=None):
        tensor += self.peers[self.calls]  # first the flat gradients, then (loss, target tokens)
        self.calls += 1
        return _Work()

    def num_participants(self):
        return 1 + (self.peers[1][1] > 0)

    def should_commit(self):
        return self.commit


class _Data:
    def count_targets(self, first, count):
        return 10 * count  # every sample has 10 target tokens


def _wrapped(manager):
    """A 2-group FaultTolerantOptimizer over a tiny linear model, as group 0, after one backward."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2, bias=False)
    recipe = _recipe(dp=2)
    opt = FaultTolerantOptimizer(Optimizer(model, ParallelDims(), TrainConfig(lr=0.1)), ParallelDims(), recipe,
                                 Replica(0, 2, 1))
    loader = Loader(_Data(), global_batch=8, dp_rank=0, dp_size=2)  # each group's slice is 4 samples
    loader.samples = 16  # step 2 served
    opt.trainer = types.SimpleNamespace(model=model, loader=loader, step=1, tokens_seen=0)
    opt.manager = manager
    model.weight.grad = torch.ones_like(model.weight)
    opt.replica_loss = 1.5
    return opt, model


def test_all_groups_live_sum_exactly_and_a_missing_group_leaves_the_mean_over_the_samples_seen():
    peer_grad = torch.full((6,), 3.0)
    opt, model = _wrapped(_Manager([peer_grad, torch.tensor([2.5, 40.0], dtype=torch.float64)]))
    _, _, extra = opt.sync_step(2, lambda k: 0.0, 0.0, lambda norm: None)  # lr 0: the step leaves weights
    assert (model.weight.grad == 4.0).all() and extra["loss"] == 4.0 and extra["ft_replicas"] == 2
    opt, model = _wrapped(_Manager([torch.zeros(6), torch.zeros(2, dtype=torch.float64)]))  # group 1 is dead
    _, _, extra = opt.sync_step(2, lambda k: 0.0, 0.0, lambda norm: None)
    # 40 of the 80 target tokens were seen: the gradient and the loss are scaled to their mean
    assert (model.weight.grad == 2.0).all() and extra["loss"] == 3.0 and extra["ft_replicas"] == 1


def test_an_uncommitted_step_is_taken_again_with_the_same_batch():
    opt, model = _wrapped(_Manager([torch.zeros(6), torch.zeros(2, dtype=torch.float64)], commit=False))
    before = model.weight.detach().clone()
    _, _, extra = opt.sync_step(2, lambda k: 0.1, 0.0, lambda norm: None)
    assert extra["ft_committed"] is False and (model.weight == before).all()
    assert opt.trainer.step == 0 and opt.trainer.loader.samples == 8  # the trainer's += 1 brings back step 1


class _OneGroup:
    """torchft's Manager for a lone replica group whose exchange fails (should_commit False) on the given
    attempts, counted over the run."""

    def __init__(self, failing):
        self.failing, self.attempts = set(failing), 0

    def start_quorum(self):
        pass

    def num_participants(self):
        return 1

    def allreduce(self, tensor, reduce_op=None):
        return _Work()

    def should_commit(self):
        self.attempts += 1
        return self.attempts not in self.failing


def _fit(out, failing):
    """A 3-step single-process run under FaultTolerantOptimizer with _OneGroup(failing): (history, the step
    lines of its metrics.jsonl)."""
    os.makedirs(out)
    trainer = build_trainer(LLAMA, str(out), steps=3)
    optimizer = FaultTolerantOptimizer(trainer.optimizer, trainer.dims, trainer.recipe, Replica(0, 1, 1))
    optimizer.attach(trainer)
    optimizer.manager = _OneGroup(failing)
    trainer.optimizer = optimizer
    history = trainer.fit()
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return history, [r for r in map(json.loads, f) if "loss" in r]


def test_a_redone_step_is_logged_once_with_its_failed_attempts(tmp_path):
    """Step 2's exchange fails twice (attempts 2 and 3), then commits: metrics.jsonl and the history have one
    line per step, step 2's saying it was redone twice, and every loss is the uninterrupted run's (the redo
    takes the same batch)."""
    history, lines = _fit(tmp_path / "redone", failing={2, 3})
    assert [r["step"] for r in lines] == [r["step"] for r in history] == [1, 2, 3]
    assert [r.get("ft_redone", 0) for r in lines] == [0, 2, 0]
    assert all(r["ft_redone_wait_s"] >= 0 for r in lines if "ft_redone" in r)
    assert "ft_committed" not in json.dumps(lines)
    _, plain = _fit(tmp_path / "plain", failing=())
    assert [r["loss"] for r in lines] == [r["loss"] for r in plain]


def test_recipe_combinations_torchft_refuses_name_the_key():
    def problems(**parallel):
        return " | ".join(parallel_problems(Recipe(parallel=ParallelConfig(fault_tolerance="torchft", **parallel))))

    assert "parallel.dp: must be given under parallel.fault_tolerance=torchft" in problems()
    assert "parallel.dp_sync=local_sgd: does not combine" in problems(dp=2, dp_sync="local_sgd", dp_shard=1)
    assert "parallel.ps_servers=1: does not combine" in problems(dp=2, ps_servers=1)
    assert "parallel.zero=1: is not implemented" in problems(dp=2, zero=1)
