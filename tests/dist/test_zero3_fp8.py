"""ZeRO-3 with train.precision=fp8 on gloo CPU processes (emulated fp8): the fp8 linears' weights are gathered
already quantised, one byte an element, with the whole weight's scale (pipetrain/parallel/data/zero3.py).

Against zero 1 in the same layout, bit for bit, training losses and the evaluation after each step (which
runs before the next step's zero_grad, on the scales of the weights just updated): dp 2; dp 2 x tp 2 with
sequence parallelism (the scales reduced over dp and tp) and dp 2 x pp 2 with the split backward,
slow-marked. Against one process with the same two microbatches (dp 2): the first step within fp32
round-off, later ones within fp8's curve tolerance (the gradients are summed in another order, and e5m2
rounding magnifies that). dp 2 also checks what a block holds as it starts (its fp8 weights at one byte),
the bytes gathered in each dtype, that autograd saves the gathered fp8 weight itself where zero 1 saves a
quantised copy of every weight, and a bitwise resume. Rowwise recipes (no float8 gather: their weights gathered
in fp32) against zero 1 the same way, and the memory model's block unit against the bytes a block holds."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.plan.memory import zero3_unit_bytes
from pipetrain.parallel.tensor.fp8 import FORWARD_DTYPE
from tests.dist.test_fp8 import FP8_TP_CURVE
from tests.harness import EXACT_FP32, rank_results
from tests.unit.common import LLAMA, build_trainer
from tests.unit.test_fp8_lora import LORA

STEPS = 3
LLAMA4 = dataclasses.replace(LLAMA, n_layers=4)
# name: (world size, tp, pp, parallel keys)
LAYOUTS = {
    "dp2": (2, 1, 1, {}),
    "dp2_tp2": (4, 2, 1, {"sequence_parallel": True}),
    "dp2_pp2_split_backward": (4, 1, 2, {"schedule": "1f1b", "split_backward": True}),
}
KEYS = dict(precision="fp8", learnable=True, microbatches=2, val_fraction=0.25)


def _trainer(out: str, dims: ParallelDims, **keys):
    os.makedirs(out, exist_ok=True)
    return build_trainer(LLAMA4, out, dims, **KEYS, **keys)


def _skewed(trainer, dims: ParallelDims):
    """trainer, with tp rank 1's shard of the first block's wq (column-parallel: its rows) 2^-12 times its
    value at tp > 1, so that the whole weight's scale leaves most of that shard fp8 subnormals and a scale taken
    per shard would not (tests/dist/test_fp8.py does this to single linears)."""
    if dims.tp > 1 and dims.tp_rank == 1 and len(trainer.model.layers):
        weight = next(iter(trainer.model.layers.values())).attn.wq.weight
        opt = trainer.optimizer
        with torch.no_grad():  # zero 3: the rows are the master (the parameter holds no values)
            rows = weight if not hasattr(opt, "rows") else \
                opt.rows.get(next(i for i, p in enumerate(opt.params) if p is weight))
            if rows is not None:
                rows.mul_(2.0 ** -12)
    return trainer


def _saved_fp8(trainer) -> tuple[int, int]:
    """One training step of trainer; the fp8 tensors autograd saved for backward: (the fp8 weights held between
    calls themselves (an Fp8Weight's data: zero 3's gathered one, or the weight cache's), every other one
    (quantised inputs, and copies of weights))."""
    holders = [m.fp8.gathered.data for m in trainer.model.modules()
               if getattr(m, "fp8", None) is not None and m.fp8.gathered is not None]
    saved = [0, 0]

    def pack(x):
        if x.dtype == FORWARD_DTYPE:
            saved[0 if any(x is h for h in holders) else 1] += 1
        return x
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        trainer.train_step()
    return tuple(saved)


def _worker(rank, world_size, out, name):
    _, tp, pp, extra = LAYOUTS[name]
    dims = ParallelDims.from_degrees(tp=tp, pp=pp)
    shared = os.path.join(out, "zero3")
    z3 = _skewed(_trainer(shared, dims, zero=3, steps=STEPS, **extra), dims)
    opt = z3.optimizer
    res = {"fp8_weights": len(opt.fp8_weights),
           "fp8_modules": sum(getattr(m, "fp8", None) is not None for m in z3.model.modules())}
    held = []
    for block in z3.model.layers.values():  # storage of parameters and fp8 weights as each block starts
        block.register_forward_pre_hook(lambda m, a: held.append(
            sum(opt.gatherer.target(i).untyped_storage().nbytes() for i in range(len(opt.params)))))
    res["losses"], res["evals"] = [], []
    for step in range(STEPS):
        res["losses"].append(z3.train_step()["loss"])
        res["evals"].append(z3.evaluate()["eval_loss"])  # after a step, before the next zero_grad
        if step == STEPS - 2:
            z3.checkpointer.save(z3)
    res["held"] = sorted(set(held))
    block = next(iter(z3.model.layers.values()))
    res["block_bytes"] = sum(p.numel() * (1 if p.dim() == 2 else 4) for p in block.parameters())
    res["gathered"] = {str(k): v for k, v in opt.gatherer.gathered_bytes.items()}
    res["has_head"] = getattr(z3.model, "head", None) is not None
    res["resumed"] = _trainer(shared, dims, zero=3, steps=STEPS, resume="auto", **extra).train_step()["loss"]
    if name == "dp2":  # one process, the same two microbatches
        if rank == 0:
            single = _trainer(os.path.join(out, "single"), ParallelDims(), steps=STEPS)
            res["reference"] = [single.train_step()["loss"] for _ in range(STEPS)]
        runs = [_trainer(os.path.join(out, f"saved{z}"), dims, zero=z, steps=1, **extra)
                for z in (1, 3)]
        res["saved"] = [_saved_fp8(t) for t in runs]
        res["saved_per_step"] = res["fp8_weights"] * KEYS["microbatches"]  # each linear's W, per microbatch
    z1 = _skewed(_trainer(os.path.join(out, "zero1"), dims, zero=1, steps=STEPS, **extra), dims)
    res["zero1"], res["zero1_evals"] = [], []
    for _ in range(STEPS):
        res["zero1"].append(z1.train_step()["loss"])
        res["zero1_evals"].append(z1.evaluate()["eval_loss"])
    return res


def _check(results, name):
    for rank, res in enumerate(results):
        assert res["losses"] == res["zero1"], (rank, res["losses"], res["zero1"])
        assert res["evals"] == res["zero1_evals"], (rank, res["evals"], res["zero1_evals"])
        if "reference" in res:  # dp 2, rank 0: one process, whose gradients are summed in another order: the
            # first step within fp32 round-off, then within fp8's curve tolerance (tests/dist/test_fp8.py says why)
            torch.testing.assert_close(res["losses"][0], res["reference"][0], **EXACT_FP32)
            assert res["losses"] == pytest.approx(res["reference"], **FP8_TP_CURVE), (res["losses"], res["reference"])
        assert res["fp8_weights"] == res["fp8_modules"] > 0, res
        assert res["resumed"] == res["losses"][-1], (rank, res["resumed"], res["losses"])
        # a block runs with only its own weights whole (the next one's gather is in flight), fp8 at one byte
        assert res["held"] == [res["block_bytes"]], (rank, res["held"], res["block_bytes"])
        # blocks gather fp8 weights and fp32 norms; the head (an untied llama's, on the last stage) bf16
        head = {"torch.bfloat16"} if res["has_head"] else set()
        assert set(res["gathered"]) == {str(FORWARD_DTYPE), "torch.float32"} | head, res["gathered"]
        if name == "dp2":
            # zero 3 saves the gathered weight (freed with its unit), zero 1 its weight cache's (2 microbatches:
            # fp8.Fp8WeightCache), neither a quantised copy of its own; both the same quantised inputs
            (zero1_held, zero1_fresh), (zero3_gathered, zero3_fresh) = res["saved"]
            assert zero1_held == zero3_gathered == res["saved_per_step"] and zero1_fresh == zero3_fresh, res["saved"]


def test_zero3_fp8_dp2_equals_zero1_bit_for_bit_and_one_process(tmp_path):
    _check(rank_results(2, _worker, str(tmp_path), "dp2"), "dp2")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp2_tp2", "dp2_pp2_split_backward"])
def test_zero3_fp8_layouts_equal_zero1(tmp_path, name):
    _check(rank_results(LAYOUTS[name][0], _worker, str(tmp_path), name), name)


def _rowwise_worker(rank, world_size, out, name, recipe):
    """Zero 3 under a rowwise fp8 recipe against zero 1 in the same layout: no float8 gather (a scale per row is
    not one scale), the block linears' weights gathered in fp32 and quantised by the linear as at zero 1."""
    _, tp, pp, extra = LAYOUTS[name]
    dims = ParallelDims.from_degrees(tp=tp, pp=pp)
    keys = dict(fp8_recipe=recipe, steps=STEPS, **extra)
    z3 = _skewed(_trainer(os.path.join(out, "zero3"), dims, zero=3, **keys), dims)
    opt = z3.optimizer
    held = []
    for block in z3.model.layers.values():  # storage of the parameters as each block starts
        block.register_forward_pre_hook(lambda m, a: held.append(
            sum(opt.gatherer.target(i).untyped_storage().nbytes() for i in range(len(opt.params)))))
    res = {"fp8_weights": len(opt.fp8_weights), "losses": [], "evals": []}
    for step in range(STEPS):
        res["losses"].append(z3.train_step()["loss"])
        res["evals"].append(z3.evaluate()["eval_loss"])
        if step == STEPS - 2:
            z3.checkpointer.save(z3)
    res["held"] = sorted(set(held))
    res["modelled"] = zero3_unit_bytes(z3.recipe, dims.pp_rank)[1]  # the memory model's block unit
    res["gathered"] = {str(k) for k in opt.gatherer.gathered_bytes}
    res["has_head"] = getattr(z3.model, "head", None) is not None
    res["resumed"] = _trainer(os.path.join(out, "zero3"), dims, zero=3, resume="auto", **keys).train_step()["loss"]
    z1 = _skewed(_trainer(os.path.join(out, "zero1"), dims, zero=1, **keys), dims)
    res["zero1"], res["zero1_evals"] = [], []
    for _ in range(STEPS):
        res["zero1"].append(z1.train_step()["loss"])
        res["zero1_evals"].append(z1.evaluate()["eval_loss"])
    return res


def _check_rowwise(results):
    for rank, res in enumerate(results):
        assert res["losses"] == res["zero1"] and res["evals"] == res["zero1_evals"], (rank, res)
        assert res["resumed"] == res["losses"][-1], (rank, res["resumed"], res["losses"])
        assert res["fp8_weights"] == 0, res  # nothing gathered in float8
        head = {"torch.bfloat16"} if res["has_head"] else set()
        assert res["gathered"] == {"torch.float32"} | head, res["gathered"]
        assert res["held"] == [res["modelled"]], (rank, res["held"], res["modelled"])  # block weights at 4 bytes


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_zero3_rowwise_fp8_dp2_gathers_fp32_weights_and_equals_zero1_bit_for_bit(tmp_path, recipe):
    _check_rowwise(rank_results(2, _rowwise_worker, str(tmp_path), "dp2", recipe))


@pytest.mark.slow
def test_zero3_rowwise_fp8_dp2_tp2_equals_zero1_bit_for_bit(tmp_path):
    _check_rowwise(rank_results(4, _rowwise_worker, str(tmp_path), "dp2_tp2", "rowwise"))


def _lora_worker(rank, world_size, out):
    dims = ParallelDims.from_degrees()
    losses = {}
    for zero in (1, 3):
        os.makedirs(os.path.join(out, f"zero{zero}"), exist_ok=True)
        trainer = build_trainer(LORA, os.path.join(out, f"zero{zero}"), dims, precision="fp8", learnable=True,
                                microbatches=2, steps=STEPS, zero=zero)
        losses[zero] = [trainer.train_step()["loss"] for _ in range(STEPS)]
    return losses


def test_zero3_fp8_lora_equals_zero1_bit_for_bit(tmp_path):
    """LoRA's frozen fp8 bases under zero 3: gathered in float8 as any fp8 weight, the adapters in fp32."""
    for rank, losses in enumerate(rank_results(2, _lora_worker, str(tmp_path))):
        assert losses[3] == losses[1] and losses[1][-1] != losses[1][0], (rank, losses)
