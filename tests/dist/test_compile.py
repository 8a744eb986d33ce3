"""train.compile across layouts: every block compiled (fullgraph) gives the eager single-process loss at every
step, and compiles once (no recompile across steps or microbatches).

The matrix runs the aot_eager backend (PIPETRAIN_COMPILE_BACKEND): it traces exactly what inductor would
(dynamo, fullgraph, AOT autograd's joint forward/backward) but runs eager kernels, so the losses match the
eager run bit for bit in fp32 and a case takes seconds instead of inductor's minute of C++ compilation on
CPU; tests/e2e/test_compile.py runs inductor end to end.
"""
from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
from torch._dynamo.utils import counters

from pipetrain.models.compile import BACKEND_ENV
from pipetrain.parallel.pipeline import executor
from pipetrain.parallel.pipeline.schedules import W
from pipetrain.parallel.mesh.dims import ParallelDims
from tests.harness import EXACT_FP32, TP_FP32, rank_results
from tests.unit.common import LLAMA, TINY_MOE, build_trainer

STEPS = 3

# name -> (tp, pp, parallel keys, tolerance against one eager process)
LAYOUTS = {
    "tp2": (2, 1, {}, TP_FP32),
    "tp2_sequence_parallel": (2, 1, {"sequence_parallel": True}, TP_FP32),
    "pp2_1f1b": (1, 2, {"schedule": "1f1b"}, EXACT_FP32),
    "pp2_interleaved": (1, 2, {"schedule": "interleaved-1f1b", "virtual_stages": 2, "layers": 4}, EXACT_FP32),
    "pp2_zbv": (1, 2, {"schedule": "zbv", "virtual_stages": 2, "split_backward": True, "layers": 4}, EXACT_FP32),
    "pp2_1f1b_split_backward": (1, 2, {"schedule": "1f1b", "split_backward": True}, EXACT_FP32),
    "tp2_recompute_full": (2, 1, {"recompute": "full"}, TP_FP32),
    "pp2_recompute_selective": (1, 2, {"recompute": "selective"}, EXACT_FP32),
    "dp2_zero1": (1, 1, {"zero": 1}, EXACT_FP32),
    "dp2_zero3": (1, 1, {"zero": 3}, EXACT_FP32),  # the gather hooks run eagerly around each compiled forward
    "tp2_lora": (2, 1, {"lora": True}, TP_FP32),
    # experts (the test-only key "moe": a qwen3_moe of LLAMA's size, aux loss and aux-free bias on)
    "tp2_moe": (2, 1, {"moe": True}, TP_FP32),
    "tp2_sequence_parallel_moe": (2, 1, {"moe": True, "sequence_parallel": True}, TP_FP32),
    "pp2_moe_recompute_full": (1, 2, {"moe": True, "recompute": "full"}, EXACT_FP32),
    "dp2_zero3_moe": (1, 1, {"moe": True, "zero": 3}, EXACT_FP32),
    # expert parallelism: a MoE block's pieces compiled around its eager dispatch (models/compile.py)
    "dp2_ep2_moe": (1, 1, {"moe": True, "ep": 2}, EXACT_FP32),
    "dp2_ep2_zero3_moe_recompute_full": (1, 1, {"moe": True, "ep": 2, "zero": 3, "recompute": "full"}, EXACT_FP32),
}
# graphs a rank compiles under ep: the norm (both norms of every block), the attention, the shared expert; each
# once
EP_PIECE_GRAPHS = 3
MOE = TINY_MOE


def _model(keys: dict):
    """LLAMA (MOE with the test-only key "moe") with the test-only keys "lora" (rank-4 adapters) and "layers"
    (n_layers) taken out of keys."""
    model = MOE if keys.pop("moe", False) else LLAMA
    model = dataclasses.replace(model, n_layers=keys.pop("layers", model.n_layers))
    return dataclasses.replace(model, lora_rank=4) if keys.pop("lora", False) else model


def _losses(rank: int, world_size: int, out: str, tp: int, pp: int, keys: dict, compile_: bool):
    """Per-step losses of one layout, and the compile counters after the first step and after the last."""
    keys = dict(keys)
    model = _model(keys)
    dims = ParallelDims.from_degrees(tp=tp, pp=pp, ep=keys.get("ep", 1))
    trainer = build_trainer(model, out, dims, steps=STEPS, microbatches=4 if pp > 1 else 2, compile=compile_, **keys)
    block_weights = {id(p) for p in trainer.model.layers.parameters()}
    at_w = []  # dW of compiled blocks' weights that W actions added (the split backward's deferral)

    def apply_at_w(work, apply=executor.apply_weight_grads):
        at_w.extend(1 for weight, *_ in work if id(weight) in block_weights)
        apply(work)
    with mock.patch.object(executor, "apply_weight_grads", apply_at_w):
        losses = [trainer.train_step()["loss"]]
        first = dict(counters["stats"])
        losses += [trainer.train_step()["loss"] for _ in range(STEPS - 1)]
    has_w = any(a.kind == W for a in trainer.actions)  # a first stage's W may be merged into its B
    return losses, first, dict(counters["stats"]), (has_w, len(at_w))


def _reference(tmp_path, keys: dict) -> list[float]:
    keys = dict(keys)
    model = _model(keys)
    keys.pop("zero", None)
    keys.pop("ep", None)
    keys.pop("sequence_parallel", None)
    keys.pop("virtual_stages", None)
    keys.pop("split_backward", None)
    keys["schedule"] = "1f1b"
    trainer = build_trainer(model, str(tmp_path), steps=STEPS, microbatches=2, **keys)
    return [trainer.train_step()["loss"] for _ in range(STEPS)]


def check_layout(name: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "aot_eager")  # spawned ranks inherit it
    tp, pp, keys, tol = LAYOUTS[name]
    (tmp_path / "ref").mkdir()
    expected = _reference(tmp_path / "ref", keys)
    world = max(tp * pp, 2)
    (tmp_path / "run").mkdir()
    results = rank_results(world, _losses, str(tmp_path / "run"), tp, pp, keys, True)
    split = keys.get("split_backward", False) or keys.get("schedule") == "zbv"
    assert any(has_w for *_, (has_w, _) in results) == split, name
    for rank, (losses, first, last, (has_w, at_w)) in enumerate(results):
        # a rank with W actions defers its compiled blocks' dW to them (weight_grads._compiled_linear)
        assert (at_w > 0) == has_w, f"{name} rank {rank}: {at_w} block weight gradients added at W"
        # every block of a rank has the same structure: one graph serves them all, compiled once. Under LoRA
        # the first block's input needs no gradient (the embedding is frozen): its graph has no dx, a second one
        graphs = EP_PIECE_GRAPHS if "ep2" in name else 2 if name.endswith("lora") else 1
        assert first.get("unique_graphs") == graphs, f"{name} rank {rank}: {first}"
        assert last == first, f"{name} rank {rank}: recompiled after the first step: {first} -> {last}"
    losses = results[-1][0]  # the last rank holds the last stage (the loss is the world's on every rank)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), **tol)


def test_tp2_compiled_blocks_match_eager_single_process(tmp_path, monkeypatch):
    check_layout("tp2", tmp_path, monkeypatch)


def test_zero3_compiled_blocks_match_eager_single_process(tmp_path, monkeypatch):
    check_layout("dp2_zero3", tmp_path, monkeypatch)


def test_tp2_compiled_experts_match_eager_single_process(tmp_path, monkeypatch):
    check_layout("tp2_moe", tmp_path, monkeypatch)


def test_ep2_compiled_pieces_match_eager_single_process(tmp_path, monkeypatch):
    check_layout("dp2_ep2_moe", tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in LAYOUTS if n not in ("tp2", "dp2_zero3", "tp2_moe", "dp2_ep2_moe")])
def test_every_layout_compiled_matches_eager_single_process(name, tmp_path, monkeypatch):
    check_layout(name, tmp_path, monkeypatch)


def _zero3_losses(rank: int, world_size: int, out: str, precision: str, compile_: bool):
    """Per-step losses of dp 2 zero 3, and the compile counters after the last step."""
    trainer = build_trainer(LLAMA, out, ParallelDims.from_degrees(), steps=STEPS, zero=3,
                            precision=precision, microbatches=2, compile=compile_)
    return [trainer.train_step()["loss"] for _ in range(STEPS)], dict(counters["stats"])


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_zero3_low_precision_compiled_blocks_match_eager_zero3(tmp_path, monkeypatch, precision):
    """Under bf16 ZeRO-3 the blocks' linear weights are bf16 parameters (parallel/data/zero3.py); under fp8 they
    hold no values and each fp8 linear reads the float8 weight its unit gathered. The compiled graphs take them
    as inputs, compile once, and the losses equal the eager zero 3 run's (fp8: the first bit for bit, later
    ones within 1e-3, as tests/unit/test_compile.py finds without zero 3: aot_eager's traced backward rounds a
    few gradients differently, and e5m2 gradients magnify that)."""
    monkeypatch.setenv(BACKEND_ENV, "aot_eager")
    for run in ("eager", "compiled"):
        (tmp_path / run).mkdir()
    (eager, _), (compiled, stats) = (rank_results(2, _zero3_losses, str(tmp_path / run), precision,
                                                  run == "compiled")[0] for run in ("eager", "compiled"))
    assert stats.get("unique_graphs") == 1, stats
    if precision == "fp8":
        assert compiled[0] == eager[0] and compiled == pytest.approx(eager, rel=1e-3), (compiled, eager)
    else:
        torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), **EXACT_FP32)
