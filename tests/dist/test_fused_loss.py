"""train.fused_loss across layouts on gloo CPU processes: tp 2 (vocab-parallel fused op; with sequence
parallelism too), pp 2 with a tied head on the last stage (and the split backward), and dp 2 under ZeRO-3
(whose head weight the loss reads without the head's forward) each give the single-process unfused run's
loss and gradient norm at every step. One world of 2 runs every layout."""
from __future__ import annotations

import dataclasses
import importlib
import json
import os

import torch

from pipetrain.parallel.mesh.dims import ParallelDims
from tests.harness import TP_FP32, run_ranks
from tests.unit.common import GPT2, LLAMA, build_trainer

GPT4 = dataclasses.replace(GPT2, n_layers=4)  # tied: pp 2 keeps a copy of the embedding as the head
STEPS = 3
COMMON = dict(steps=STEPS, microbatches=2)
LAYOUTS = {  # name: (model, tp, pp, parallel kwargs)
    "tp2": (LLAMA, 2, 1, {}),
    "tp2_sp": (LLAMA, 2, 1, {"sequence_parallel": True}),
    "pp2_tied": (GPT4, 1, 2, {}),
    "pp2_tied_split": (GPT4, 1, 2, {"split_backward": True}),  # the head's dW leaves the deferred W
    "dp2_zero3": (LLAMA, 1, 1, {"zero": 3}),  # the head gathered around the loss, and again for its backward
}


def _run(cfg, out, dims=None, fused=True, **kw):
    os.makedirs(out, exist_ok=True)
    trainer = build_trainer(cfg, out, dims, fused_loss=fused, **{**COMMON, **kw})
    records = [trainer.train_step() for _ in range(STEPS)]
    gatherer = getattr(trainer.optimizer, "gatherer", None)  # ZeRO-3: the head unit's gathers per pass
    head = [(g["forward"][-1], g["backward"][-1]) for g in [gatherer.unit_gathers]] if gatherer else []
    return [r["loss"] for r in records], [r["grad_norm"] for r in records], head


def _worker(rank, world_size, out_dir, results_path):
    # several chunks per microbatch (22 of 64 tokens): the per-chunk all-reduces run (a worker process)
    importlib.import_module("pipetrain.kernels.linear_cross_entropy").MIN_CHUNK_ROWS = 1
    results = {}
    for name, (cfg, tp, pp, kw) in LAYOUTS.items():
        dims = ParallelDims.from_degrees(tp=tp, pp=pp)
        results[name] = _run(cfg, os.path.join(out_dir, name), dims, **kw)
    if rank == 0:
        with open(results_path, "w") as f:
            json.dump(results, f)


def test_fused_loss_layouts_match_the_unfused_single_process_run(tmp_path):
    reference = {cfg.family: _run(cfg, str(tmp_path / f"single_{cfg.family}"), fused=False) for cfg in (LLAMA, GPT4)}
    path = str(tmp_path / "results.json")
    run_ranks(2, _worker, str(tmp_path), path)
    with open(path) as f:
        results = json.load(f)
    for name, (cfg, *_rest) in LAYOUTS.items():
        (got_losses, got_norms, head), (want_losses, want_norms, _) = results[name], reference[cfg.family]
        if name == "dp2_zero3":  # the loss frees the head and its backward gathers it again, every microbatch
            assert head == [[STEPS * COMMON["microbatches"]] * 2], head
        torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), **TP_FP32, msg=name)
        torch.testing.assert_close(torch.tensor(got_norms), torch.tensor(want_norms), **TP_FP32, msg=name)
