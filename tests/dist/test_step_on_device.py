"""The step on the device (pipetrain.optim.build.Optimizer.clip_and_step: fused AdamW, clip and divergence check
with no host read) across tp 2 x pp 2 on 4 gloo processes against one process on the same path, with the clip
acting (tests/unit/test_step_on_device.py runs it against the host path)."""
from __future__ import annotations

import os

import torch

import pipetrain.optim.adamw as adamw
from pipetrain.parallel.mesh.dims import ParallelDims
from tests.dist.common import replica_trainer
from tests.harness import TP_FP32, rank_results

STEPS, CLIP = 4, 0.5


def _run(out: str, dims: ParallelDims) -> dict:
    adamw.FUSED_DEVICES = ("cuda", "cpu")  # this process only (a worker, or the test's own below)
    os.makedirs(out, exist_ok=True)
    trainer = replica_trainer(out, dims, steps=STEPS, grad_clip=CLIP)
    assert trainer.optimizer.steps_on_device
    records = [trainer.train_step() for _ in range(STEPS)]
    return {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records]}


def _worker(rank, world_size, out):
    return _run(os.path.join(out, f"rank{rank}"), ParallelDims.from_degrees(tp=2, pp=2))


def test_the_step_on_the_device_under_tp2_pp2_gives_the_single_process_run(tmp_path, monkeypatch):
    ranks = rank_results(4, _worker, str(tmp_path / "world"))
    monkeypatch.setattr(adamw, "FUSED_DEVICES", adamw.FUSED_DEVICES)  # restored after _run sets it here
    single = _run(str(tmp_path / "single"), ParallelDims())
    assert all(n > CLIP for n in single["norms"][:2]), single["norms"]  # the clip acts
    for r in ranks:  # every rank reports the global loss and norm
        torch.testing.assert_close(r["losses"], single["losses"], **TP_FP32)
        torch.testing.assert_close(r["norms"], single["norms"], **TP_FP32)
