"""The step on the device (clip_and_step of pipetrain.optim.build.Optimizer and of ZeRO: fused AdamW, clip and
divergence check with no host read) on 4 gloo processes, across tp 2 x pp 2 and across dp 2 x tp 2 under ZeRO 1,
2 and 3, against one process on the same path, with the clip acting (tests/unit/test_step_on_device.py runs it
against the host path)."""
from __future__ import annotations

import os

import torch

import pipetrain.optim.adamw as adamw
from pipetrain.parallel.mesh.dims import ParallelDims
from tests.dist.common import replica_trainer
from tests.harness import TP_FP32, rank_results

STEPS, CLIP = 4, 0.5


LAYOUTS = {"tp2_pp2": (dict(tp=2, pp=2), {}), "dp2_tp2_zero1": (dict(tp=2), dict(zero=1)),
           "dp2_tp2_zero2": (dict(tp=2), dict(zero=2)), "dp2_tp2_zero3": (dict(tp=2), dict(zero=3))}


def _run(out: str, dims: ParallelDims, **keys) -> dict:
    adamw.FUSED_DEVICES = ("cuda", "cpu")  # this process only (a worker, or the test's own below)
    os.makedirs(out, exist_ok=True)
    trainer = replica_trainer(out, dims, steps=STEPS, grad_clip=CLIP, **keys)
    assert trainer.optimizer.steps_on_device
    records = [trainer.train_step() for _ in range(STEPS)]
    return {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records]}


def _worker(rank, world_size, out):
    return {name: _run(os.path.join(out, name, f"rank{rank}"), ParallelDims.from_degrees(**degrees), **keys)
            for name, (degrees, keys) in LAYOUTS.items()}


def test_the_step_on_the_device_in_every_layout_gives_the_single_process_run(tmp_path, monkeypatch):
    ranks = rank_results(4, _worker, str(tmp_path / "world"))
    monkeypatch.setattr(adamw, "FUSED_DEVICES", adamw.FUSED_DEVICES)  # restored after _run sets it here
    single = _run(str(tmp_path / "single"), ParallelDims())
    assert all(n > CLIP for n in single["norms"][:2]), single["norms"]  # the clip acts
    for name in LAYOUTS:
        for r in ranks:  # every rank reports the global loss and norm
            torch.testing.assert_close(r[name]["losses"], single["losses"], **TP_FP32, msg=name)
            torch.testing.assert_close(r[name]["norms"], single["norms"], **TP_FP32, msg=name)
