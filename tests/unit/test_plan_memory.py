"""The planner's memory model against what a run allocates.

Model states: gloo ranks build the real run (tests/unit/common.build_trainer) for a grid of dp / tp / pp /
ZeRO layouts, take one step and count the bytes of the parameters, of the gradients after reduce_grads and
of the AdamW moments after the step; the prediction must equal them exactly.
Activations: one process builds each pp stage (ParallelDims constructed directly: stage building needs
no process group) and counts the unique non-parameter storages autograd saves for one microbatch's
forward (saved_tensors_hooks, as benchmarks/memory.py does). That is the per-microbatch figure the model
multiplies by the schedule's in-flight count; tensor parallelism needs processes and is left to the
benchmark.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest
import torch

from pipetrain.config import DataConfig, ModelConfig, ParallelConfig, Recipe, TrainConfig
from pipetrain.models import build, materialize
from pipetrain.parallel.data.allreduce import DEFAULT_BUCKET_BYTES
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.pipeline.stage import build_stage
from pipetrain.parallel.pipeline.recompute import apply_recompute
from pipetrain.parallel.pipeline.weight_grads import apply_grad_accumulation_fusion, deferring, weight_grad_modules
from pipetrain.parallel.data.zero3 import compute_in_bf16
from pipetrain.parallel.tensor.fp8 import FP8_PLAN, apply_fp8
from pipetrain.plan.memory import (activation_bytes, deferred_w_bytes, model_state_bytes, rank_memory,
                                   weight_grad_operand_bytes, zero3_unit_bytes)
from pipetrain.plan.shapes import rank_stages
from tests.harness import run_ranks, saved_activation_bytes
from tests.unit.common import GPT2, LLAMA, TINY_MOE, build_trainer

# (model, dp, tp, pp, zero, extra parallel keys); dp*tp*pp = 2. LLAMA's rows divide by 2 (no ZeRO padding).
GRID = [(LLAMA, 2, 1, 1, 0, {}), (LLAMA, 2, 1, 1, 1, {}), (LLAMA, 2, 1, 1, 2, {}), (GPT2, 2, 1, 1, 2, {}),
        (LLAMA, 1, 2, 1, 0, {}), (LLAMA, 1, 2, 1, 0, {"sequence_parallel": True}), (GPT2, 1, 2, 1, 0, {}),
        (LLAMA, 1, 1, 2, 0, {"microbatches": 2}), (GPT2, 1, 1, 2, 0, {"microbatches": 2})]


def _recipe(model, dp, tp, pp, zero, extra, global_batch=8, seq_len=16) -> Recipe:
    return Recipe(model=model, parallel=ParallelConfig(dp=dp, tp=tp, pp=pp, zero=zero, **extra),
                  train=TrainConfig(global_batch=global_batch, seq_len=seq_len))


def _measure_worker(rank: int, world_size: int, out: str) -> None:
    rows = []
    for k, (model, dp, tp, pp, zero, extra) in enumerate(GRID):
        dims = ParallelDims.from_degrees(dp=dp, tp=tp, pp=pp, world_size=world_size)
        trainer = build_trainer(model, os.path.join(out, f"run{k}"), dims, zero=zero, steps=1, **extra)
        opt, seen = trainer.optimizer, {}
        reduce = opt.reduce_grads

        def reduce_and_count():
            reduce()
            seen["grads"] = (opt.grad_bytes() if hasattr(opt, "grad_bytes") else
                             sum(p.grad.numel() * p.grad.element_size() for p in trainer.model.parameters()
                                 if p.grad is not None))
        opt.reduce_grads = reduce_and_count
        trainer.train_step()
        params = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
        rows.append({"pp_rank": dims.pp_rank, "dp_rank": dims.dp_rank, "measured": [params, seen["grads"],
                                                                                       opt.state_bytes()]})
        trainer.logger.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)


def test_model_state_bytes_equal_what_a_run_allocates(tmp_path):
    for k in range(len(GRID)):
        os.makedirs(tmp_path / f"run{k}")
    run_ranks(2, _measure_worker, str(tmp_path))
    for rank in range(2):
        rows = json.load(open(tmp_path / f"rank{rank}.json"))
        for layout, row in zip(GRID, rows):
            predicted = model_state_bytes(_recipe(*layout), 2, row["pp_rank"])
            assert list(predicted) == row["measured"], (layout[1:], rank)


MID = ModelConfig(family="llama", vocab_size=512, d_model=128, n_layers=4, n_heads=8, n_kv_heads=4,
                  ffn_hidden=384, max_seq_len=64)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("model_cfg,pp", [(LLAMA, 1), (GPT2, 1), (MID, 1), (MID, 2),
                                          (dataclasses.replace(GPT2, n_layers=4), 2)])
def test_activation_bytes_within_1_percent_of_saved_tensors(model_cfg, pp, recompute):
    """Every tensor counted once: RoPE's tables once a block (not also per token), within 1% (the counts
    left out are a few words a microbatch)."""
    _check_activation_bytes(Recipe(model=model_cfg, parallel=ParallelConfig(pp=pp, recompute=recompute)))


@pytest.mark.parametrize("recompute", ["none", "selective"])
@pytest.mark.parametrize("document_mask,window", [(True, None), (False, 8), (True, 8)])
def test_activation_bytes_count_attention_masks_and_gathered_rope_rows(document_mask, window, recompute):
    """data.document_mask: RoPE gathers its rows per token (2 K a token, no tables) and SDPA keeps the
    (B, 1, T, T) mask as a bias of q's dtype; a sliding window alone: one (T, T) mask a block. Selective
    recompute reruns the core, which keeps neither."""
    _check_activation_bytes(Recipe(model=dataclasses.replace(MID, sliding_window=window), parallel=ParallelConfig(
        recompute=recompute), data=DataConfig(document_mask=document_mask)))


def _check_activation_bytes(base: Recipe, seq_len: int = 32, batch: int = 8) -> None:
    """activation_bytes of base's model and layout at 2 microbatches of batch sequences against the storages
    autograd saves in one microbatch's forward of each pp stage; documents of 12 and 20 tokens under
    data.document_mask."""
    model_cfg, pp = base.model, base.parallel.pp
    recipe = dataclasses.replace(base, model=dataclasses.replace(model_cfg, max_seq_len=seq_len),
                                 parallel=dataclasses.replace(base.parallel, microbatches=2),
                                 train=TrainConfig(global_batch=batch, seq_len=seq_len))
    micro = batch // 2
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model_cfg.vocab_size, (micro, seq_len + 1), generator=gen)
    positions = torch.cat([torch.arange(12), torch.arange(seq_len - 12)]).repeat(micro, 1) \
        if recipe.data.document_mask else None
    for pp_rank in range(pp):
        model = build(recipe.model, device="meta")
        model, _, _ = build_stage(model, ParallelDims(pp=pp, rank=pp_rank), recipe.parallel, seq_len)
        materialize(model, recipe.model, 0, "cpu")
        apply_recompute(model, recipe.parallel)
        first, last = pp_rank == 0, pp_rank == pp - 1
        x = tokens[:, :-1] if first else torch.randn(micro, seq_len, model_cfg.d_model, requires_grad=True)
        measured = saved_activation_bytes(model, x, tokens[:, 1:] if last else None, positions=positions)
        predicted = activation_bytes(recipe, pp, pp_rank, in_flight=1)
        assert abs(predicted - measured) <= 0.01 * measured, (pp_rank, predicted, measured)


def test_rank_memory_multiplies_by_the_schedules_in_flight_microbatches():
    recipe = _recipe(LLAMA, 1, 1, 2, 0, {"microbatches": 4, "schedule": "gpipe"})
    gpipe = rank_memory(recipe, 2)
    one_f = rank_memory(dataclasses.replace(recipe, parallel=dataclasses.replace(recipe.parallel, schedule="1f1b")), 2)
    assert gpipe[1].activations > one_f[1].activations  # GPipe holds all 4, 1F1B the last stage holds 1
    assert gpipe[0].params == one_f[0].params


def test_gloo_stages_zero_all_gather_through_one_more_bucket():
    """gloo's all_gather_into_tensor gathers into a flat copy and then copies it out; NCCL writes in place.
    Only ZeRO's parameter all-gather (dp > 1) pays it."""
    zero1 = _recipe(LLAMA, 2, 1, 1, 1, {})
    nccl, gloo = rank_memory(zero1, 2)[0], rank_memory(zero1, 2, staged_collectives=True)[0]
    assert gloo.gather - nccl.gather == min(DEFAULT_BUCKET_BYTES, nccl.params) > 0
    assert gloo.total >= nccl.total
    plain = _recipe(LLAMA, 2, 1, 1, 0, {})
    assert rank_memory(plain, 2, staged_collectives=True)[0].gather == rank_memory(plain, 2)[0].gather == 0


def test_a_split_backward_holds_the_deferred_weight_gradient_operands_beyond_the_saved_activations():
    """A split backward's W needs every linear's input and output gradient from the chunk's input-gradient
    passes until it runs: the output gradients are no saved activation; the inputs are, except under full
    recompute (only block inputs are saved). measured by benchmarks/planner.py: tp2 sp x pp2 with one
    microbatch peaked 16% above the model without this term."""
    joined = _recipe(LLAMA, 1, 1, 2, 0, {"microbatches": 2, "schedule": "1f1b", "recompute": "selective"})
    split = dataclasses.replace(joined, parallel=dataclasses.replace(joined.parallel, split_backward=True))
    full = dataclasses.replace(split, parallel=dataclasses.replace(split.parallel, recompute="full"))
    inputs, grads = weight_grad_operand_bytes(LLAMA, 1)
    layers = len(rank_stages(split, 0)[0])
    tokens = joined.train.global_batch // joined.parallel.microbatches * joined.train.seq_len
    assert deferred_w_bytes(joined, 2, 0) == 0
    assert deferred_w_bytes(split, 2, 0) == int(tokens * grads * layers) > 0
    assert deferred_w_bytes(full, 2, 0) == int(tokens * (inputs + grads) * layers)
    zbv = _recipe(dataclasses.replace(LLAMA, n_layers=4), 1, 1, 2, 0,
                  {"microbatches": 4, "schedule": "zbv", "virtual_stages": 2})
    assert deferred_w_bytes(zbv, 2, 0) > 0  # the V schedules always split
    assert rank_memory(split, 2)[0].total > rank_memory(joined, 2)[0].total


@pytest.mark.parametrize("model_cfg,fp8", [(LLAMA, False), (GPT2, False), (TINY_MOE, False),
                                           (dataclasses.replace(TINY_MOE, shared_expert_intermediate_size=40), False),
                                           (LLAMA, True), (TINY_MOE, True)],
                         ids=["llama", "gpt2", "moe", "moe_shared", "llama_fp8", "moe_fp8"])
def test_deferred_weight_gradient_operands_are_what_the_deferring_linears_record(model_cfg, fp8):
    """weight_grad_operand_bytes against the (x, dy) a split backward's B records for W, counted from a built
    model: every linear of a dense block; a mixture of experts' attention and shared expert (its router and
    experts compute dW in B; the shared expert deferred at tp 1 as under tp, where its linears are tp's
    WeightGradModules); under fp8 only a shared expert (the fp8 linears compute dW in B): a dense model defers
    nothing and deferred_w_bytes is 0."""
    model = build(model_cfg, device="meta")
    materialize(model, model_cfg, 0, "cpu")
    apply_grad_accumulation_fusion(model, 0)
    if fp8:
        apply_fp8(model, ParallelDims(), model_cfg, emulate=True)
    B, T = 2, 16
    tokens = torch.randint(0, model_cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    work = []
    with deferring(weight_grad_modules(model.layers), work):
        model(tokens).float().sum().backward()
    recorded = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for *_, x2, dy2 in work for t in (x2, dy2)}
    inputs, grads = weight_grad_operand_bytes(model_cfg, 1, fp8)
    assert sum(recorded.values()) == B * T * (inputs + grads) * model_cfg.n_layers
    split = Recipe(model=model_cfg, parallel=ParallelConfig(pp=2, microbatches=2, split_backward=True),
                   train=TrainConfig(global_batch=8, seq_len=16, precision="fp8" if fp8 else "fp32"))
    assert (deferred_w_bytes(split, 2, 0) == 0) == (not recorded)


def _zero3_units(model_cfg: ModelConfig, low: set[int], fp8: bool = False) -> list[int]:
    """Bytes of each ZeRO-3 unit of a single stage, in order, counted from a built model (parameters in
    `low` at 2 bytes; fp8: the weights of the fp8 linears, FP8_PLAN, at 1); a tied head's unit holds the
    embedding's table."""
    built = build(model_cfg, device="meta")
    one = {id(m.weight) for name, m in built.named_modules() if fp8 and re.sub(r"^layers\.\d+\.", "", name) in FP8_PLAN}

    def unit(*modules):
        params = {id(p): p for m in modules if m is not None for p in m.parameters()}.values()
        return sum(p.numel() * (1 if id(p) in one else 2 if id(p) in low(built) else 4) for p in params)
    return ([unit(built.embed, built.pos_embed)] + [unit(block) for block in built.layers.values()]
            + [unit(built.norm, built.head)])


def test_zero3_parameters_are_rows_plus_two_neighbouring_units_whole():
    """parallel.zero=3: every rank holds 1/dp of parameters, gradients and moments, plus a unit and its
    neighbour (embedding, blocks, norm + head) gathered whole, or every unit with reshard_after_forward false;
    the units are counted here from a built model (the tied gpt2's head unit holds the embedding's table)."""
    for model_cfg in (LLAMA, GPT2):
        full = sum(p.numel() for p in build(model_cfg, device="meta").parameters())
        units = _zero3_units(model_cfg, lambda built: set())
        for keep in (True, False):
            recipe = Recipe(model=model_cfg, parallel=ParallelConfig(zero=3, reshard_after_forward=keep),
                            train=TrainConfig(global_batch=8, seq_len=16))
            params, grads, optim = model_state_bytes(recipe, 2, 0)  # dp 2 divides every dim 0 of these models
            gathered = max(a + b for a, b in zip(units, units[1:])) if keep else 4 * full
            assert params == 4 * full // 2 + gathered, (model_cfg.family, keep)
            assert grads == 4 * full // 2 and optim == 8 * full // 2


@pytest.mark.parametrize("model", [LLAMA, GPT2], ids=["llama", "gpt2_tied"])
def test_zero3_bf16_units_hold_linear_weights_in_bf16_and_save_no_weight_copies(model):
    """train.precision=bf16 under zero 3: the gathered units hold the weights ZeRO-3 keeps in bf16 (counted here
    from a built model with compute_in_bf16) at 2 bytes, the rest at 4; and no autocast weight copy is saved."""
    def recipe(zero):
        return Recipe(model=model, parallel=ParallelConfig(zero=zero),
                      train=TrainConfig(global_batch=8, seq_len=16, precision="bf16"))
    full = sum(p.numel() for p in build(model, device="meta").parameters())
    units = _zero3_units(model, lambda built: compute_in_bf16(built, ParallelDims()))
    assert model_state_bytes(recipe(3), 2, 0)[0] == 4 * full // 2 + max(a + b for a, b in zip(units, units[1:]))
    # zero 1: a bf16 copy of every weight (2 of its 4 bytes); zero 3: of the tied head only, which stays fp32
    tied_head = model.vocab_size * model.d_model if model.tied else 0
    assert activation_bytes(recipe(3), 2, 0) + 4 * full // 2 == activation_bytes(recipe(1), 2, 0) + 2 * tied_head


@pytest.mark.parametrize("model", [LLAMA, GPT2], ids=["llama", "gpt2_tied"])
def test_zero3_fp8_units_hold_fp8_weights_at_one_byte(model):
    """train.precision=fp8 under zero 3: a unit holds its fp8 linears' weights (FP8_PLAN) gathered at one byte,
    the other weights compute_in_bf16 picks (an untied head) at 2, the rest at 4."""
    recipe = Recipe(model=model, parallel=ParallelConfig(zero=3),
                    train=TrainConfig(global_batch=8, seq_len=16, precision="fp8"))
    full = sum(p.numel() for p in build(model, device="meta").parameters())
    units = _zero3_units(model, lambda built: compute_in_bf16(built, ParallelDims()), fp8=True)
    embed, block, head, _ = zero3_unit_bytes(recipe, 0)
    assert (embed, block, head) == (units[0], units[1], units[-1]), ((embed, block, head), units)
    assert model_state_bytes(recipe, 2, 0)[0] == 4 * full // 2 + max(a + b for a, b in zip(units, units[1:]))


def test_lora_adapters_are_counted_as_trainable_state():
    """Each adapted projection adds rank x (in + out) elements a block, held with a gradient and two moments in
    fp32 (an upper bound: the frozen base's gradient and moments stay counted)."""
    def state(rank):
        model = dataclasses.replace(LLAMA, lora_rank=rank, lora_targets=["wq", "down"])
        return sum(model_state_bytes(Recipe(model=model), 1, 0))
    # wq: d 32 in, 4 heads x 8 out; down: ffn 64 in, 32 out
    assert state(16) - state(8) == 8 * ((32 + 32) + (64 + 32)) * LLAMA.n_layers * 4 * (1 + 1 + 2)


@pytest.mark.parametrize("schedule,v,split,last_units", [
    ("gpipe", 1, False, 8), ("1f1b", 1, False, 1), ("1f1b", 1, True, 1), ("interleaved-1f1b", 2, False, 1),
    ("zbv", 2, False, 1), ("dualpipev", 2, False, 1)])
def test_the_last_stages_loss_state_counts_the_microbatches_its_own_chunk_holds(schedule, v, split, last_units):
    """The loss's logits (or the fused loss's two gradients) live from the last chunk's F to its B: GPipe holds
    every microbatch's there, the others one, though the rank holds more units of its other chunk (V schedules,
    interleaving) or until their W (split backward). The model once counted them per unit of the rank."""
    from pipetrain.plan.in_flight import end_chunks_in_flight
    from pipetrain.plan.loss import fused_loss_weight_grad
    model = dataclasses.replace(LLAMA, n_layers=8, vocab_size=4096)
    recipes = {fused: Recipe(model=model, parallel=ParallelConfig(pp=4, microbatches=8, schedule=schedule,
                                                                  virtual_stages=v, split_backward=split),
                             train=TrainConfig(global_batch=16, seq_len=32, fused_loss=fused)) for fused in (False, True)}
    last_rank = 0 if schedule in ("zbv", "dualpipev") else 3
    assert end_chunks_in_flight(recipes[False], 4)[last_rank][1] == last_units
    tokens = 2 * 32  # a microbatch: 2 sequences of 32
    unfused, fused = (activation_bytes(recipes[f], 4, last_rank, fused_loss=f) for f in (False, True))
    # what the pre-flight check, the dry run and the planner report counts the same (rank_memory once passed the
    # schedule's unit counts on as a caller's bound, and the ends' extras went back to the approximation)
    assert rank_memory(recipes[False], 4)[last_rank].activations == unfused
    # fused: no fp32 logits per token, the head's weight gradient per microbatch instead (D 32 < 64 tokens: they differ)
    assert fused != unfused and fused - unfused == last_units * (fused_loss_weight_grad(recipes[True]) - 4 * tokens * model.vocab_size)


@pytest.mark.parametrize("pp", [1, 2])
def test_recompute_layers_counts_the_blocks_it_leaves_whole(pp):
    """parallel.recompute_layers N: full recompute for the first N blocks of each stage, the rest keep everything
    (the model once counted every block as recomputed)."""
    seq_len, batch = 32, 8
    recipes = {name: Recipe(model=dataclasses.replace(MID, max_seq_len=seq_len),
                            parallel=ParallelConfig(pp=pp, microbatches=2, recompute=recompute, recompute_layers=n),
                            train=TrainConfig(global_batch=batch, seq_len=seq_len))
               for name, recompute, n in (("none", "none", None), ("full", "full", None), ("one", "full", 1),
                                          ("zero", "full", 0))}
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MID.vocab_size, (batch // 2, seq_len + 1), generator=gen)
    for pp_rank in range(pp):
        model = build(recipes["one"].model, device="meta")
        model, _, _ = build_stage(model, ParallelDims(pp=pp, rank=pp_rank), recipes["one"].parallel, seq_len)
        materialize(model, recipes["one"].model, 0, "cpu")
        apply_recompute(model, recipes["one"].parallel)
        first, last = pp_rank == 0, pp_rank == pp - 1
        x = tokens[:, :-1] if first else torch.randn(batch // 2, seq_len, MID.d_model, requires_grad=True)
        measured = saved_activation_bytes(model, x, tokens[:, 1:] if last else None)
        planned = {name: activation_bytes(r, pp, pp_rank, in_flight=1) for name, r in recipes.items()}
        assert planned["full"] < planned["one"] < planned["none"] == planned["zero"], planned  # 0: none recomputed
        assert abs(planned["one"] - measured) <= 0.15 * measured, (pp_rank, planned, measured)


def test_recompute_layers_counts_each_of_a_ranks_uneven_stages():
    """recompute_layers applies per stage: on interleaved pp 2 with stages of 3 and 1 layers on a rank, N = 2 reruns
    2 + 1 blocks, not twice min(2, the average 2)."""
    model = dataclasses.replace(MID, n_layers=8)
    def recipe(n, stage_layers=(3, 1, 3, 1)):
        return Recipe(model=model, parallel=ParallelConfig(pp=2, virtual_stages=2, schedule="interleaved-1f1b",
                                                           microbatches=2, recompute="full", recompute_layers=n,
                                                           stage_layers=list(stage_layers)),
                      train=TrainConfig(global_batch=8, seq_len=16))
    from pipetrain.plan.shapes import rank_stage_layers
    assert [len(s) for s in rank_stage_layers(recipe(2), 0)] == [3, 3]
    assert [len(s) for s in rank_stage_layers(recipe(2), 1)] == [1, 1]
    # rank 1's stages of one layer: N 1 and N 2 rerun the same blocks
    assert activation_bytes(recipe(1), 2, 1, in_flight=1) == activation_bytes(recipe(2), 2, 1, in_flight=1)
    even = recipe(2, (2, 2, 2, 2))  # rank 0: stages of 2 and 2 with N 2: all recomputed, as N None
    assert activation_bytes(even, 2, 0, in_flight=1) == activation_bytes(recipe(None, (2, 2, 2, 2)), 2, 0, in_flight=1)
    uneven = [recipe(n, (3, 1, 1, 3)) for n in (1, 2, 3)]  # rank 0 holds stages of 3 and 1: N 1, 2, 3 rerun 2, 3, 4
    a, b, c = (activation_bytes(r, 2, 0, in_flight=1) for r in uneven)
    assert a > b > c and a - b == b - c  # each N reruns one more block of the 3-layer stage only
