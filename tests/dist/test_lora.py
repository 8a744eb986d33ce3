"""LoRA's layout rule on gloo CPU processes: tp 2 (with and without sequence parallelism, and with
replicated kv heads), pp 2 (also with the split backward and full recomputation) and dp 2 x ZeRO 1 / 2
each give the single-process losses and gradient norms step by step, and the frozen base stays bitwise
unchanged. One world of 2 runs every layout."""
from __future__ import annotations

import dataclasses
import json
import os

import torch

from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.models.lora import is_adapter
from tests.harness import TP_FP32, run_ranks
from tests.unit.common import LLAMA, build_trainer

LORA = dataclasses.replace(LLAMA, lora_rank=4, lora_alpha=8.0)
LORA_KV1 = dataclasses.replace(LORA, n_kv_heads=1)  # tp 2 > kv heads: replicated wk / wv
STEPS = 3
COMMON = dict(steps=STEPS, lr=5e-2, microbatches=2)
LAYOUTS = {  # name: (model, tp, pp, zero, parallel kwargs)
    "tp2": (LORA, 2, 1, 0, {}),
    "tp2_sp": (LORA, 2, 1, 0, {"sequence_parallel": True}),
    "tp2_kv1": (LORA_KV1, 2, 1, 0, {}),
    "pp2": (LORA, 1, 2, 0, {}),
    # deferred weight gradients (none for the frozen base) and full recomputation of the adapted blocks
    "pp2_split_recompute": (LORA, 1, 2, 0, {"split_backward": True, "recompute": "full"}),
    "dp2_zero1": (LORA, 1, 1, 1, {}),
    "dp2_zero2": (LORA, 1, 1, 2, {}),  # the overlapped reduction's accumulate hooks on the adapters
}


def _run(cfg, out, dims=None, zero=0, **kw):
    os.makedirs(out, exist_ok=True)
    trainer = build_trainer(cfg, out, dims, zero=zero, **{**COMMON, **kw})
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not is_adapter(n)}
    records = [trainer.train_step() for _ in range(STEPS)]
    changed = [n for n, p in trainer.model.named_parameters() if not is_adapter(n) and not torch.equal(p, base[n])]
    return [r["loss"] for r in records], [r["grad_norm"] for r in records], changed


def _worker(rank, world_size, out_dir, results_path):
    results = {}
    for name, (cfg, tp, pp, zero, kw) in LAYOUTS.items():
        dims = ParallelDims.from_degrees(tp=tp, pp=pp)
        losses, norms, changed = _run(cfg, os.path.join(out_dir, name), dims, zero=zero, **kw)
        results[name] = {"loss": losses, "grad_norm": norms, "changed": changed}
    if rank == 0:
        with open(results_path, "w") as f:
            json.dump(results, f)


def test_lora_layouts_match_one_process(tmp_path):
    reference = {}
    for cfg in (LORA, LORA_KV1):
        losses, norms, changed = _run(cfg, str(tmp_path / "single"))
        assert not changed
        reference[cfg.n_kv_heads] = (losses, norms)
    assert reference[2][0][-1] != reference[2][0][0]  # the adapters do train
    path = str(tmp_path / "results.json")
    run_ranks(2, _worker, str(tmp_path), path)
    with open(path) as f:
        results = json.load(f)
    for name, (cfg, *_rest) in LAYOUTS.items():
        got = results[name]
        want_losses, want_norms = reference[cfg.n_kv_heads]
        assert not got["changed"], f"{name}: frozen base weights changed: {got['changed'][:3]}"
        torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(want_losses), **TP_FP32, msg=name)
        torch.testing.assert_close(torch.tensor(got["grad_norm"]), torch.tensor(want_norms), **TP_FP32, msg=name)
