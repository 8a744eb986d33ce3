"""The step on the device (clip_and_step of pipetrain.optim.build.Optimizer and of ZeRO: fused AdamW, clip and
divergence check with no host read) on 4 gloo processes, across tp 2 x pp 2, across dp 2 x tp 2 under ZeRO 1, 2
and 3, and an MoE over dp 4 x ep 2 under ZeRO 1 (experts sharded over expert-dp: two fused AdamWs), against one
process on the same path, with the clip acting (tests/unit/test_step_on_device.py runs it against the host
path)."""
from __future__ import annotations

import os

import torch

import pipetrain.optim.adamw as adamw
from pipetrain.parallel.mesh.dims import ParallelDims
from tests.dist.common import replica_trainer
from tests.dist.test_moe import MOE
from tests.harness import TP_FP32, rank_results

STEPS, CLIP = 4, 0.5


LAYOUTS = {"tp2_pp2": (dict(tp=2, pp=2), {}), "dp2_tp2_zero1": (dict(tp=2), dict(zero=1)),
           "dp2_tp2_zero2": (dict(tp=2), dict(zero=2)), "dp2_tp2_zero3": (dict(tp=2), dict(zero=3)),
           "moe_dp4_ep2_zero1": (dict(ep=2), dict(ep=2, zero=1, model=MOE))}


def _run(out: str, dims: ParallelDims, **keys) -> dict:
    adamw.FUSED_DEVICES = ("cuda", "cpu")  # this process only (a worker, or the test's own below)
    os.makedirs(out, exist_ok=True)
    trainer = replica_trainer(out, dims, steps=STEPS, grad_clip=CLIP, **keys)
    assert trainer.optimizer.steps_on_device, type(trainer.optimizer).__name__
    records = [trainer.train_step() for _ in range(STEPS)]
    # AdamW's first moments: sums of the clipped gradients, so they see a clip the losses barely show (Adam's
    # update is nearly invariant to a gradient scale); each rank's boxes of the global tensors
    moments = [(n, t.detach().clone(), g, o) for n, t, g, o in trainer.optimizer.state_items()
               if n.startswith("exp_avg/")]
    return {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records], "moments": moments}


def _whole(runs: list[dict]) -> dict[str, torch.Tensor]:
    """The global first-moment tensors from every rank's boxes (boxes held by several ranks agree)."""
    whole = {}
    for run in runs:
        for name, box, shape, offsets in run["moments"]:
            target = whole.setdefault(name, torch.zeros(shape))
            target[tuple(slice(o, o + n) for o, n in zip(offsets, box.shape))] = box
    return whole


def _worker(rank, world_size, out):
    return {name: _run(os.path.join(out, name, f"rank{rank}"), ParallelDims.from_degrees(**degrees), **keys)
            for name, (degrees, keys) in LAYOUTS.items()}


def test_the_step_on_the_device_in_every_layout_gives_the_single_process_run(tmp_path, monkeypatch):
    ranks = rank_results(4, _worker, str(tmp_path / "world"))
    monkeypatch.setattr(adamw, "FUSED_DEVICES", adamw.FUSED_DEVICES)  # restored after _run sets it here
    single = {"dense": _run(str(tmp_path / "single"), ParallelDims()),
              "moe": _run(str(tmp_path / "single-moe"), ParallelDims(), model=MOE)}
    for run in single.values():
        assert all(n > CLIP for n in run["norms"][:2]), run["norms"]  # the clip acts
    for name, (_, keys) in LAYOUTS.items():
        want = single["moe" if "model" in keys else "dense"]
        for r in ranks:  # every rank reports the global loss and norm
            torch.testing.assert_close(r[name]["losses"], want["losses"], **TP_FP32, msg=name)
            torch.testing.assert_close(r[name]["norms"], want["norms"], **TP_FP32, msg=name)
        got, ref = _whole([r[name] for r in ranks]), _whole([want])
        assert sorted(got) == sorted(ref), name
        for moment in ref:
            torch.testing.assert_close(got[moment], ref[moment], **TP_FP32, msg=f"{name}: {moment}")
