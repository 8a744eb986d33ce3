"""Relaxed synchronisation across replicas on 4 gloo CPU processes (pipetrain.parallel.replicas.stale, .periodic).

One world of 4 runs every case once and saves its measurements; each test checks one claim:
bsp over dp_replicate 2 x dp_shard 2 (ZeRO 1) gives the single-process run; ssp s=0 is bsp bitwise;
local_sgd H=1 with SGD is bsp to round-off; diloco (outer_lr 1, momentum 0, H=1) is local_sgd H=1;
the SSP bound holds in per-rank clock logs under transient and persistent injected stragglers, and the
replicas end bitwise identical and equal whatever the straggler pattern; replicas are identical after a
sync without any drain; ssp and local_sgd compose with tp 2 inside a replica, and every mode with pp 2
inside a replica; over ZeRO shards, a checkpoint leaves local_sgd and diloco runs unchanged and a resume
continues them bitwise, ssp continues its drained run exactly, dssp resumes with identical replicas,
and a bsp run loads each (tests/dist/test_relaxed_checkpoint.py checks checkpoints on and off syncs).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from pipetrain.config import FaultsConfig
from pipetrain.parallel.mesh.dims import ParallelDims
from tests.dist.common import replica_trainer
from tests.harness import EXACT_FP32, TP_FP32, rank_results

STEPS, S = 6, 2
LAYOUT_AFTER_ADAM = dict(rtol=1e-4, atol=1e-5)  # as tests/dist/test_zero.py: round-off signs after AdamW


def _make(out, dims, *, steps=STEPS, **kw):
    return replica_trainer(out, dims, steps=steps, **kw)


def _flat(trainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in trainer.model.parameters()])


def _run(out, dims, steps=STEPS, drain=True, **kw):
    trainer = _make(out, dims, steps=steps, **kw)
    records = [trainer.train_step() for _ in range(steps)]
    if drain:
        trainer.drain_replicas()
    return trainer, records


def _worker(rank, world_size, out):
    torch.manual_seed(0)
    res = {}
    one = ParallelDims()
    hsdp = ParallelDims.from_degrees(dp_shard=2)  # dp_replicate 2 x dp_shard 2
    four = ParallelDims.from_degrees(dp_shard=1)  # 4 replicas
    sgd = dict(optimizer="sgd", grad_clip=0.0, lr=0.1)

    # bsp over dp_replicate x dp_shard (ZeRO 1 over dp_shard) against the single process
    _, ref = _run(out, one, zero=1)
    t, bsp = _run(out, hsdp, zero=1)
    res["hsdp"] = {"ref": [r["loss"] for r in ref], "bsp": [r["loss"] for r in bsp],
                   "ref_norms": [r["grad_norm"] for r in ref], "norms": [r["grad_norm"] for r in bsp]}
    res["hsdp_bsp_params"] = _flat(t)
    t, ssp0 = _run(out, hsdp, zero=1, dp_sync="ssp", staleness=0)
    res["hsdp_ssp0_params"] = _flat(t)

    # local_sgd H=1 with SGD == bsp; diloco (outer lr 1, momentum 0, H=1) == local_sgd H=1; 4 replicas
    res["sgd_bsp"] = _flat(_run(out, four, **sgd)[0])
    res["sgd_local"] = _flat(_run(out, four, dp_sync="local_sgd", sync_every=1, **sgd)[0])
    res["sgd_diloco"] = _flat(_run(out, four, dp_sync="diloco", sync_every=1, outer_lr=1.0, outer_momentum=0.0,
                                   **sgd)[0])
    # replicas after step 6, a sync step of both (no drain: nothing averages them but the sync itself)
    res["diloco_h2"] = _flat(_run(out, four, drain=False, dp_sync="diloco", sync_every=2)[0])
    res["local_h2_warm"] = _flat(_run(out, four, drain=False, dp_sync="local_sgd", sync_every=2,
                                      sync_warmup_steps=2)[0])
    res["dssp"] = _flat(_run(out, four, dp_sync="dssp", staleness=S, staleness_min=1)[0])  # drain applies, not averages

    # the SSP bound under injected stragglers; the same weights whatever the pattern
    patterns = {"none": FaultsConfig(),
                "transient": FaultsConfig(slow_ranks=[1, 2], slow_factor=6.0, slow_prob=0.4, seed=3),
                "persistent": FaultsConfig(slow_ranks=[3], slow_factor=4.0, slow_prob=1.0)}
    for name, faults in patterns.items():
        dist.barrier()
        trainer = _make(out, four, steps=STEPS, dp_sync="ssp", staleness=S, faults=faults)
        log = []
        for _ in range(STEPS):
            rec = trainer.train_step()
            log.append({"clock": rec["step"], "applied": rec["applied"], "delay": rec.get("injected_delay_s", 0.0),
                        "lead": rec["clock_lead"], "lag": rec["clock_lag"], "wait_s": rec["wait_s"],
                        "bytes": rec["replica_bytes"]})
        undrained = _flat(trainer)
        trainer.drain_replicas()
        res[f"ssp_{name}"] = {"log": log, "params": _flat(trainer), "undrained": undrained}

    # composition: tp 2 inside each of 2 replicas
    tp2 = ParallelDims.from_degrees(tp=2, dp_shard=1)
    res["tp_bsp"] = _flat(_run(out, tp2, **sgd)[0])
    res["tp_local"] = _flat(_run(out, tp2, dp_sync="local_sgd", sync_every=1, **sgd)[0])
    res["tp_ssp"] = _flat(_run(out, tp2, dp_sync="ssp", staleness=1)[0])
    res["tp_ssp0"] = _flat(_run(out, tp2, dp_sync="ssp", staleness=0)[0])
    res["tp_bsp_adam"] = _flat(_run(out, tp2)[0])  # two replicas: a flat sum of two equals the replica sum

    # composition: a 2-stage pipeline inside each of 2 replicas, every mode
    pp2 = ParallelDims.from_degrees(pp=2, dp_shard=1)
    res["pp_bsp"] = _flat(_run(out, pp2, microbatches=2, **sgd)[0])
    res["pp_local"] = _flat(_run(out, pp2, microbatches=2, dp_sync="local_sgd", sync_every=1, **sgd)[0])
    res["pp_diloco"] = _flat(_run(out, pp2, microbatches=2, dp_sync="diloco", sync_every=1, outer_lr=1.0,
                                  outer_momentum=0.0, **sgd)[0])
    res["pp_ssp0"] = _flat(_run(out, pp2, microbatches=2, dp_sync="ssp", staleness=0, **sgd)[0])
    for mode, kw in {"ssp": dict(staleness=1), "dssp": dict(staleness=2, staleness_min=1),
                     "local_sgd": dict(sync_every=2), "diloco": dict(sync_every=2)}.items():
        res[f"pp_{mode}_h"] = _flat(_run(out, pp2, microbatches=2, dp_sync=mode, **kw)[0])

    # checkpoint / resume over ZeRO shards: save at step 3 (between syncs), continue to 6; a resumed run
    # reaches the same weights; local_sgd / diloco: both are the run without a checkpoint
    for mode, kw in {"ssp": dict(dp_sync="ssp", staleness=S), "local_sgd": dict(dp_sync="local_sgd", sync_every=2),
                     "diloco": dict(dp_sync="diloco", sync_every=2, outer_momentum=0.9),
                     "dssp": dict(dp_sync="dssp", staleness=S, staleness_min=1)}.items():
        ck_out = os.path.join(out, f"ck-{mode}")
        if rank == 0:
            os.makedirs(ck_out, exist_ok=True)
        dist.barrier()
        trainer = _make(ck_out, hsdp, zero=1, **kw)
        for _ in range(3):
            trainer.train_step()
        ckpt = trainer.checkpointer.save(trainer)
        at3 = _flat(trainer)  # this replica's weights at the save (between syncs: the replicas differ)
        for _ in range(3):
            trainer.train_step()
        trainer.drain_replicas()
        resumed = _make(ck_out, hsdp, zero=1, resume=ckpt, **kw)
        for _ in range(3):
            resumed.train_step()
        resumed.drain_replicas()
        bsp_loaded = _make(ck_out, hsdp, zero=1, resume=ckpt)
        res[f"ckpt_{mode}"] = {"cont": _flat(trainer), "resumed": _flat(resumed), "start": resumed.step,
                               "bsp_step": bsp_loaded.step, "bsp_record": bsp_loaded.train_step()["loss"]}
        if mode in ("local_sgd", "diloco"):
            res[f"ckpt_{mode}"]["straight"] = _flat(_run(ck_out, hsdp, drain=False, zero=1, **kw)[0])
            # 2 replicas of 2 ZeRO shards resumed as 4 replicas of one rank: each starts from the average
            four_loaded = _make(ck_out, four, resume=ckpt, **kw)
            res[f"ckpt_{mode}"].update(at3=at3, four=_flat(four_loaded),
                                       four_record=four_loaded.train_step()["loss"])
    dist.barrier()
    return res


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return rank_results(4, _worker, str(tmp_path_factory.mktemp("relaxed-world4")))


def test_bsp_over_replicas_and_shards_matches_the_single_process(world4):
    for res in world4:
        h = res["hsdp"]
        torch.testing.assert_close(h["bsp"][0], h["ref"][0], **EXACT_FP32)
        torch.testing.assert_close(h["bsp"], h["ref"], **LAYOUT_AFTER_ADAM)
        torch.testing.assert_close(h["norms"], h["ref_norms"], **LAYOUT_AFTER_ADAM)


def test_ssp_with_staleness_0_is_bsp_bitwise(world4):
    for res in world4:
        assert torch.equal(res["hsdp_ssp0_params"], res["hsdp_bsp_params"])


def test_local_sgd_h1_with_sgd_is_bsp_and_diloco_h1_is_local_sgd(world4):
    for res in world4:
        torch.testing.assert_close(res["sgd_local"], res["sgd_bsp"], **EXACT_FP32)
        torch.testing.assert_close(res["sgd_diloco"], res["sgd_local"], **EXACT_FP32)


def test_replicas_are_identical_after_a_sync_and_after_an_ssp_or_dssp_drain(world4):
    """local_sgd / diloco at a sync step and ssp at any clock, undrained; dssp after its drain, which
    applies the pending summed updates (it averages nothing)."""
    for key in ("diloco_h2", "local_h2_warm", "dssp", "ssp_none"):
        params = [res[key]["undrained"] if isinstance(res[key], dict) else res[key] for res in world4]
        for p in params[1:]:  # 4 replicas of one rank each: every rank holds the whole model
            assert torch.equal(p, params[0]), key


def _bound_violations(world4, name: str) -> list:
    logs = [res[f"ssp_{name}"]["log"] for res in world4]
    bad = []
    for a, log in enumerate(logs):
        for entry in log:
            c = entry["clock"]
            if c > S:  # applied set: exactly the update of clock c - S (the update of every clock <= c - S)
                if entry["applied"] != [c - S]:
                    bad.append((a, c, "applied", entry["applied"]))
            elif entry["applied"]:
                bad.append((a, c, "applied early", entry["applied"]))
    # No wall clocks compared across ranks (hosts' clocks differ): applying clock c - S at clock c waited
    # for the all-reduce of clock c - S, which completes only once every replica has reached it.
    return bad


@pytest.mark.parametrize("name", ["transient", "persistent"])
def test_ssp_bound_holds_under_injected_stragglers(world4, name):
    assert _bound_violations(world4, name) == []
    delays = [sum(e["delay"] for e in res[f"ssp_{name}"]["log"]) for res in world4]
    slow = {"transient": [1, 2], "persistent": [3]}[name]
    assert all(delays[r] > 0 for r in slow) and all(delays[r] == 0 for r in range(4) if r not in slow), delays
    for res in world4:
        log = res[f"ssp_{name}"]["log"]
        assert all(e["lag"] == min(e["clock"], S) for e in log)
        assert all(e["bytes"] > 0 for e in log)


def test_ssp_replicas_are_bitwise_identical_and_independent_of_stragglers(world4):
    base = world4[0]["ssp_none"]["params"]
    for res in world4:
        for name in ("none", "transient", "persistent"):
            assert torch.equal(res[f"ssp_{name}"]["params"], base), name


def test_modes_compose_with_tp_inside_a_replica(world4):
    for res in world4:
        torch.testing.assert_close(res["tp_local"], res["tp_bsp"], **TP_FP32)
        assert torch.equal(res["tp_ssp0"], res["tp_bsp_adam"])
    # replicas (ranks 0,2 and 1,3 hold the same tp shard) end identical under ssp
    assert torch.equal(world4[0]["tp_ssp"], world4[2]["tp_ssp"])
    assert torch.equal(world4[1]["tp_ssp"], world4[3]["tp_ssp"])


def test_every_mode_composes_with_a_pipeline_inside_a_replica(world4):
    for res in world4:  # exact special cases: local_sgd H=1 and diloco (lr 1, no momentum) H=1 are bsp; ssp s=0 too
        torch.testing.assert_close(res["pp_local"], res["pp_bsp"], **TP_FP32)
        torch.testing.assert_close(res["pp_diloco"], res["pp_local"], **EXACT_FP32)
        assert torch.equal(res["pp_ssp0"], res["pp_bsp"])
    # ranks 0,2 (stage 0) and 1,3 (stage 1) are the two replicas' copies of a stage: identical after drain
    for mode in ("ssp", "dssp", "local_sgd", "diloco"):
        assert torch.equal(world4[0][f"pp_{mode}_h"], world4[2][f"pp_{mode}_h"]), mode
        assert torch.equal(world4[1][f"pp_{mode}_h"], world4[3][f"pp_{mode}_h"]), mode


@pytest.mark.parametrize("mode", ["ssp", "local_sgd", "diloco"])
def test_resumed_relaxed_run_continues_exactly_and_loads_into_bsp(world4, mode):
    for res in world4:
        ck = res[f"ckpt_{mode}"]
        assert ck["start"] == 6 and ck["bsp_step"] == 3
        assert torch.equal(ck["resumed"], ck["cont"])
        if mode != "ssp":  # the save changed nothing: both are the run without a checkpoint
            assert torch.equal(ck["cont"], ck["straight"])
        assert np.isfinite(ck["bsp_record"])
    if mode != "ssp":  # step 6 is a sync step: replicas (ranks 0, 1 and 2, 3: ZeRO gathers full weights) agree
        assert torch.equal(world4[2][f"ckpt_{mode}"]["cont"], world4[0][f"ckpt_{mode}"]["cont"])


@pytest.mark.parametrize("mode", ["local_sgd", "diloco"])
def test_another_replica_count_starts_every_replica_from_the_average(world4, mode):
    a, b = world4[0][f"ckpt_{mode}"]["at3"], world4[2][f"ckpt_{mode}"]["at3"]  # replicas 0 and 1
    assert not torch.equal(a, b)
    for res in world4:
        assert torch.equal(res[f"ckpt_{mode}"]["four"], (a + b) * 0.5)
        assert np.isfinite(res[f"ckpt_{mode}"]["four_record"])


def test_a_resumed_dssp_run_continues_with_identical_replicas_and_loads_into_bsp(world4):
    """dssp's applied set depends on timing, so its continuation is not bitwise the uninterrupted run's;
    what holds is that it resumes at the drained step, its replicas end identical, and bsp loads it."""
    for res in world4:
        ck = res["ckpt_dssp"]
        assert ck["start"] == 6 and ck["bsp_step"] == 3 and np.isfinite(ck["bsp_record"])
    # ranks 0, 1 are replica 0 and ranks 2, 3 replica 1 (ZeRO shards; each rank gathers the full weights)
    for a, b in ((2, 0), (3, 1), (1, 0)):
        assert torch.equal(world4[a]["ckpt_dssp"]["resumed"], world4[b]["ckpt_dssp"]["resumed"]), (a, b)
