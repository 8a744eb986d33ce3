"""A checkpoint saved in one layout loads into any other, on 2 gloo CPU processes, in the default run.

The default suite's resharding case (one process -> dp2 zero2) never saves a tensor-parallel shard: where a
tp shard's box sits in the global tensor (checkpoint/read.py's slice_offsets, used by the save and the load
alike) is only exercised by the slow tp2 x pp2 case. Here a tp 2 run saves after 2 AdamW steps and each
rank loads the checkpoint into one process: every parameter and both moments there, cut at this rank's
tp slice, are this rank's shard bitwise (a load is a copy), and the next step's loss agrees to tp round-off.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from pipetrain.models.init import param_layout
from pipetrain.parallel.mesh.dims import ParallelDims
from tests.dist.common import replica_trainer
from tests.harness import TP_FP32, rank_results

STEPS = 4


def _moments(optimizer) -> dict:
    return {n: (t.detach().clone(), tuple(o)) for n, t, _, o in optimizer.state_items()
            if n.split("/")[0] in ("exp_avg", "exp_avg_sq")}


def _worker(rank, world_size, out):
    tp2 = ParallelDims.from_degrees(tp=2)
    if rank == 0:
        os.makedirs(os.path.join(out, "tp2"))
    dist.barrier()  # test code: the harness's gloo world
    os.makedirs(os.path.join(out, f"one-{rank}"))
    trainer = replica_trainer(os.path.join(out, "tp2"), tp2, steps=STEPS)
    for _ in range(2):
        trainer.train_step()
    ckpt = trainer.checkpointer.save(trainer)
    one = replica_trainer(os.path.join(out, f"one-{rank}"), ParallelDims(), steps=STEPS, resume=ckpt)
    full = dict(one.model.named_parameters())
    bad = [name for name, (_, slices) in param_layout(trainer.model).items()
           if not torch.equal(full[name].detach()[slices], dict(trainer.model.named_parameters())[name].detach())]
    full_moments = {n: t for n, (t, _) in _moments(one.optimizer).items()}
    for name, (local, offsets) in _moments(trainer.optimizer).items():
        box = tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))
        if not torch.equal(full_moments[name][box], local):
            bad.append(name)
    return {"bad": bad, "start": one.step, "loss": trainer.train_step()["loss"], "one_loss": one.train_step()["loss"]}


def test_a_tp2_checkpoint_loads_into_one_process_shard_for_shard(tmp_path):
    """Weights and AdamW moments loaded into one process equal, at each tp rank's slice, that rank's own
    tensors; the continued step agrees within tp round-off."""
    results = rank_results(2, _worker, str(tmp_path))
    for rank, res in enumerate(results):
        assert res["start"] == 2 and res["bad"] == [], (rank, res["bad"])
        torch.testing.assert_close(res["one_loss"], res["loss"], **TP_FP32)
