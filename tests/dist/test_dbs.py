"""Dynamic batch sizing on 4 gloo CPU processes (pipetrain.parallel.replicas.dbs).

One world of 4 runs every case once; each test checks one claim: with bsp the loss at every step is the
single process's while the split moves (4 replicas, one slowed by injected faults; pp 2 inside each of 2
replicas; ZeRO 1, 2 and 3 over dp_shard 2 inside each of 2 replicas), a replica's time per pipeline slot is
measured as its step's compute over counts + pp - 1 slots (under a controlled clock), and a run resumed
mid-way continues the saved split and the uninterrupted run's losses.
"""
from __future__ import annotations

import os
import types

import pytest
import torch
import torch.distributed as dist

import pipetrain.trainer
from pipetrain.config import FaultsConfig
from pipetrain.parallel.mesh.dims import ParallelDims
from tests.dist.common import replica_trainer
from tests.harness import EXACT_FP32, rank_results

STEPS = 8
LAYOUT_AFTER_ADAM = dict(rtol=1e-4, atol=1e-5)  # as tests/dist/test_zero.py: round-off signs after AdamW
SLOW = FaultsConfig(slow_ranks=[3], slow_factor=4.0, slow_prob=1.0)


def _make(out, dims, **kw):
    return replica_trainer(out, dims, steps=STEPS, **kw)


def _steps(trainer, n):
    """n steps as fit() takes them: each followed by the agreement that feeds the split."""
    records = []
    for _ in range(n):
        records.append(trainer.train_step())
        trainer.agree()
    return records


SLOT_S = (1.0, 1.35)  # the controlled clock's seconds per pipeline slot of replicas 0 and 1


def _clocked_pp2(out, dims):
    """2 replicas of a 2-stage pipeline under a controlled clock: a step of k microbatches takes exactly
    SLOT_S[replica] x (k + pp - 1) seconds of compute. Returns every agreed measurement the split saw, and
    the split after each step."""
    clock = [0.0]
    trainer = _make(out, dims, microbatches=4, dynamic_batch=True, dynamic_batch_every=2)
    run = trainer.forward_backward

    def timed(batch, num_targets):
        loss = run(batch, num_targets)
        clock[0] += SLOT_S[dims.dp_replicate_rank] * trainer.dbs.slots(trainer.microbatches())
        return loss

    seen, counts = [], []
    observe = trainer.dbs.observe
    trainer.forward_backward = timed
    trainer.dbs.observe = lambda slot: (seen.append(list(slot)), observe(slot))
    real_time, pipetrain.trainer.time = pipetrain.trainer.time, types.SimpleNamespace(perf_counter=lambda: clock[0])
    try:
        for _ in range(STEPS):
            trainer.train_step()
            trainer.agree()
            counts.append(list(trainer.dbs.counts))
    finally:
        pipetrain.trainer.time = real_time
    return {"seen": seen, "counts": counts}


def _worker(rank, world_size, out):
    torch.manual_seed(0)
    res = {}
    one = ParallelDims()
    four = ParallelDims.from_degrees(dp_shard=1)  # 4 replicas of one rank
    pp2 = ParallelDims.from_degrees(pp=2, dp_shard=1)  # 2 replicas of a 2-stage pipeline

    res["ref"] = [r["loss"] for r in _steps(_make(out, one, microbatches=2), STEPS)]
    records = _steps(_make(out, four, microbatches=2, dynamic_batch=True, dynamic_batch_every=2, faults=SLOW), STEPS)
    res["four"] = {"loss": [r["loss"] for r in records], "shares": [r["dbs_shares"] for r in records]}
    records = _steps(_make(out, pp2, microbatches=4, dynamic_batch=True, dynamic_batch_every=2,
                           faults=FaultsConfig(slow_ranks=[2, 3], slow_factor=4.0, slow_prob=1.0)), STEPS)
    res["pp2"] = {"loss": [r["loss"] for r in records], "shares": [r["dbs_shares"] for r in records]}
    res["clocked"] = _clocked_pp2(out, pp2)
    hsdp = ParallelDims.from_degrees(dp_shard=2)  # 2 replicas x dp_shard 2: ZeRO shards inside each replica
    for zero in (1, 2, 3):  # the overlapped reduction waits for each step's own microbatch count
        records = _steps(_make(out, hsdp, microbatches=2, dp_shard=2, zero=zero, dynamic_batch=True,
                               dynamic_batch_every=2, faults=SLOW), STEPS)
        res[f"zero{zero}"] = {"loss": [r["loss"] for r in records], "shares": [r["dbs_shares"] for r in records]}

    ck_out = os.path.join(out, "ck")
    if rank == 0:
        os.makedirs(ck_out, exist_ok=True)
    dist.barrier()
    kw = dict(microbatches=2, dynamic_batch=True, dynamic_batch_every=2, faults=SLOW)
    trainer = _make(ck_out, four, **kw)
    _steps(trainer, 4)
    saved_counts = list(trainer.dbs.counts)
    ckpt = trainer.checkpointer.save(trainer)
    cont = _steps(trainer, 4)
    resumed = _make(ck_out, four, resume=ckpt, **kw)
    res["resume"] = {"saved": saved_counts, "restored": list(resumed.dbs.counts), "start": resumed.step,
                     "cont": [r["loss"] for r in cont], "resumed": [r["loss"] for r in _steps(resumed, 4)]}
    res["resume"]["other_layout"] = list(_make(ck_out, hsdp, resume=ckpt, dp_shard=2, **kw).dbs.counts)
    dist.barrier()
    return res


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return rank_results(4, _worker, str(tmp_path_factory.mktemp("dbs-world4")))


@pytest.mark.parametrize("case", ["four", "pp2", "zero1", "zero2", "zero3"])
def test_bsp_with_a_moving_split_gives_the_single_process_loss_at_every_step(world4, case):
    """zero1 / zero2 / zero3: 2 replicas x dp_shard 2 with ZeRO inside each; the split moves from 2 + 2
    microbatches per rank to 3 + 1, so each replica's backward count changes mid-run under overlapped reduction
    (zero 3: and each replica gathers its parameters as many times as it runs microbatches)."""
    even = {"four": [2, 2, 2, 2], "pp2": [4, 4], "zero1": [4, 4], "zero2": [4, 4], "zero3": [4, 4]}[case]
    for res in world4:
        got = res[case]
        torch.testing.assert_close(got["loss"][0], res["ref"][0], **EXACT_FP32)
        torch.testing.assert_close(got["loss"], res["ref"], **LAYOUT_AFTER_ADAM)
        assert all(sum(s) == 8 for s in got["shares"]), got["shares"]
        assert got["shares"][0] == even  # every run starts even
        # the slowed replica (the last) lost samples to the others once its slowness was measured
        assert got["shares"][-1][-1] < even[-1] and got["shares"][-1][-1] == min(got["shares"][-1]), got["shares"]
        assert got["shares"] == world4[0][case]["shares"]  # every rank logged the same split


def test_a_replica_is_measured_per_pipeline_slot_counting_the_bubble(world4):
    """pp 2 inside each of 2 replicas, replica 1 35% slower per slot by a controlled clock: every agreed
    measurement is each replica's seconds per slot, before and after the split moves (a step of k
    microbatches is k + 1 slots; counting k, the measurement moves with the split: 6 / 5 and 1.35 x 4 / 3 at
    5 + 3). The split goes to 5 + 3 (DynamicBatch.propose of those times, tests/unit/test_dbs.py) and stays."""
    for res in world4:
        got = res["clocked"]
        assert len(got["seen"]) == STEPS
        for slot in got["seen"]:
            assert slot == pytest.approx(list(SLOT_S), rel=1e-12), got["seen"]
        assert got["counts"][0] == [4, 4] and got["counts"][-1] == [5, 3], got["counts"]
        assert got["counts"][-3:] == [[5, 3]] * 3, got["counts"]  # moved once, then held under the same times


def test_resume_continues_the_saved_split_and_the_losses(world4):
    for res in world4:
        r = res["resume"]
        assert r["start"] == 4
        assert r["restored"] == r["saved"] and r["saved"] != [2, 2, 2, 2]
        torch.testing.assert_close(r["resumed"], r["cont"], **LAYOUT_AFTER_ADAM)
        assert r["other_layout"] == [2, 2]  # the saved split was for 4 replicas: start even
