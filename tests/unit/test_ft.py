"""pipetrain.parallel.ft without processes: where a torchrun sits among the replica groups, what its layout
check sees, and every launch problem at once."""
import importlib.util

import pytest

from pipetrain.config import build_recipe
from pipetrain.parallel.ft import Replica, replica_from_env

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
