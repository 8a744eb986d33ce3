"""Every tensor reaches a collective on the device its group takes, and parallel.auto plans one layout.

comm checks each tensor against its group's backend (gloo: CPU, nccl: this rank's CUDA device). On a GPU
run the default device (CPU) is not the mesh's, so a tensor built without `device=` crashes NCCL; here the
workers run with the default device "meta" (tests/harness.py's wrong-device mode), so the same tensor fails
comm's check on gloo. Set PIPETRAIN_TEST_DEFAULT_DEVICE=meta to run any multi-process test in that mode.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch

from pipetrain.config import ParallelConfig
from pipetrain.parallel.mesh import comm
from pipetrain.parallel.mesh.comm import CommDeviceError, check_devices
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.plan.auto import resolve_at_launch, resolve_auto
from tests.dist import test_ps
from tests.dist.common import replica_trainer
from tests.harness import rank_results
from tests.unit.test_plan_search import HUGE, RECIPE


@pytest.mark.parametrize("backend, device, ok", [
    ("gloo", "cpu", True), ("gloo", "meta", False), ("nccl", "cpu", False), ("nccl", "meta", False),
    ("cpu:gloo,cuda:nccl", "cpu", True), ("cpu:gloo,cuda:nccl", "meta", False), ("fake", "meta", True)])
def test_a_tensor_off_its_groups_device_is_refused_naming_the_call(monkeypatch, backend, device, ok):
    monkeypatch.setattr(comm.dist, "get_backend", lambda pg=None: backend)
    x = torch.zeros(3, device=device)
    if ok:
        check_devices("all_reduce_", object(), x)
        return
    with pytest.raises(CommDeviceError, match=rf"comm\.all_reduce_: a \(3,\) torch.float32 tensor on {device} "
                                              rf"reached a {backend} group"):
        check_devices("all_reduce_", object(), x)


def _fit_all(out, runs: dict) -> dict:
    """Each run's losses: runs maps a name to (dims, parallel keys) of a 3-step replica_trainer fit (fit
    takes the stop agreement after every step and saves the final checkpoint)."""
    losses = {}
    for name, (dims, keys) in runs.items():
        os.makedirs(os.path.join(out, name), exist_ok=True)
        losses[name] = [r["loss"] for r in replica_trainer(os.path.join(out, name), dims, steps=3, **keys).fit()]
        assert os.path.isfile(os.path.join(out, name, "checkpoints", "latest")), name
    return losses


def _four(rank, world_size, out, slow):
    """With the default device meta, over 4 ranks: ssp and dssp on dp_replicate 2 x dp_shard 2 (ZeRO 1 in
    a replica, so dssp's count agreement runs over each replica's group) and a dynamic batch over 4
    replicas; slow: bsp, local_sgd, diloco the same way, and ssp with tp 2 inside a replica. (Resuming is
    left out: the checkpoint reader builds its read buffer without device=, on the default device.)"""
    hsdp = ParallelDims.from_degrees(dp_shard=2)
    modes = ("bsp", "local_sgd", "diloco") if slow else ("ssp", "dssp")
    runs = {f"hsdp-{m}": (hsdp, dict(zero=1, dp_sync=m, staleness=1, sync_every=2)) for m in modes}
    if slow:
        runs["tp2-ssp"] = (ParallelDims.from_degrees(tp=2, dp_shard=1), dict(dp_sync="ssp", staleness=1))
    else:
        runs["dbs"] = (ParallelDims.from_degrees(dp_shard=1), dict(dynamic_batch=True, dynamic_batch_every=1))
    return _fit_all(out, runs)


def test_relaxed_dbs_checkpoint_and_stop_agreement_build_collective_tensors_on_the_groups_device(tmp_path):
    got = rank_results(4, _four, str(tmp_path), False, default_device="meta")
    assert all(len(v) == 3 and all(math.isfinite(x) for x in v) for v in got[0].values()), got[0]


@pytest.mark.slow
def test_every_replica_mode_and_tp_build_collective_tensors_on_the_groups_device(tmp_path):
    got = rank_results(4, _four, str(tmp_path), True, default_device="meta")
    assert all(len(v) == 3 and all(math.isfinite(x) for x in v) for v in got[0].values()), got[0]


def test_parameter_servers_build_protocol_tensors_on_the_cpu(tmp_path):
    got = rank_results(3, test_ps._run, str(tmp_path), dict(ps_servers=1), 2, default_device="meta")
    assert got[0] is not None


# ---- parallel.auto: one plan for every rank ----

def _plans(rank, world_size, out, memories):
    """(layout planned alone, layout from resolve_at_launch) on a rank whose device has memories[rank]."""
    path = os.path.join(out, f"device{rank}.json")
    with open(path, "w") as f:
        json.dump(dataclasses.replace(HUGE, memory_bytes=memories[rank]).as_dict(), f)
    os.environ["PIPETRAIN_DEVICE"] = path  # launch_profile's override: this rank's own "hardware"
    recipe = dataclasses.replace(RECIPE, parallel=ParallelConfig(auto=True))
    alone = resolve_auto(recipe, world_size, {}, dataclasses.replace(HUGE, memory_bytes=memories[rank]))[1].layout
    launched = resolve_at_launch(recipe, None, (), world_size, rank).parallel
    return alone, {k: getattr(launched, k) for k in alone}


def test_ranks_with_different_memory_agree_on_the_plan_for_the_smallest(tmp_path):
    recipe = dataclasses.replace(RECIPE, parallel=ParallelConfig(auto=True))
    peak = max(m.total for m in resolve_auto(recipe, 2, {}, HUGE)[1].memory)
    memories = [HUGE.memory_bytes, 0.7 * peak]  # the unconstrained best does not fit rank 1
    (alone0, launched0), (alone1, launched1) = rank_results(2, _plans, str(tmp_path), memories)
    assert alone0 != alone1, "planned apart, the two ranks must disagree, or this test shows nothing"
    assert launched0 == launched1 == alone1
