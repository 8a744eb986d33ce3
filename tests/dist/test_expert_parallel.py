"""Expert parallelism (parallel.ep, pipetrain.parallel.expert) matches one process at every step: the loss,
the aux loss, the gradient norm, the expert loads, the aux-free bias and the router gradients, with ep
carved out of dp and composed with tp, pp and ZeRO; skewed routing drops no token; a checkpoint saved at
ep 2 resumes at ep 4 and ep 1 with the ep 2 run's next losses. Under context parallelism (cp 2 x ep 2) each cp rank
dispatches its own half of every sequence over its own ep group and the expert gradients sum over expert-dp x cp.

ZeRO-3 (ExpertZero3Optimizer): at ep 2 x dp 4 the experts shard, gather and reduce-scatter over expert-dp (2
ranks), the rest over dp (4): the losses and every gradient row match one process at every step, the final
weights too; a running block holds the bytes plan.memory models; its checkpoint resumes bitwise at ep 2 and
loads into one process with the ep 2 run's next loss.

Tolerance: EXACT_FP32 (as dp): an expert computes the same rows, only grouped by source rank, and its
weight gradient sums them in another order; TP_FP32 with tp (F split) and with cp (attention over gathered
K/V, as tests/dist/test_moe.py's cp case)."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from pipetrain.models import build, materialize, param_layout
from pipetrain.models.moe import moe_layers
from pipetrain.parallel.expert.dispatch import apply_expert_parallel
from pipetrain.parallel.expert.zero import ExpertZero3Optimizer
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.plan.memory import model_state_bytes, zero3_unit_bytes
from tests.dist.test_moe import MOE
from tests.dist.test_zero3 import AFTER_ADAM
from tests.harness import EXACT_FP32, TP_FP32, rank_results, run_ranks
from tests.unit.common import build_trainer

STEPS = 3
KEYS = ("loss", "aux_loss", "grad_norm")


def _run(out, dims=None, steps=STEPS, **parallel):
    """Per step: the metrics, and every held layer's router gradient; then the aux-free biases."""
    os.makedirs(out, exist_ok=True)
    trainer = build_trainer(MOE, out, dims, steps=steps, global_batch=4, seq_len=16, **parallel)
    history, router = [], []
    for _ in range(steps):
        record = trainer.train_step()
        history.append({k: record[k] for k in KEYS + ("expert_load_max",)})
        router.append({i: m.router.weight.grad.clone() for i, m in moe_layers(trainer.model).items()
                       if m.router.weight.grad is not None})  # ZeRO 2 keeps only its rows
    bias = {i: m.router.expert_bias.clone() for i, m in moe_layers(trainer.model).items()}
    return history, router, bias


def _worker(rank, world_size, out, degrees, parallel, expected, tol):
    dims = ParallelDims.from_degrees(**degrees)
    got = _run(out, dims, ep=degrees["ep"], **parallel)
    for step, (have, want) in enumerate(zip(got[0], expected[0]), 1):
        for key in KEYS:
            torch.testing.assert_close(have[key], want[key], **tol, msg=f"{dims.coords} step {step} {key}")
        assert have["expert_load_max"] == want["expert_load_max"], f"{dims.coords} step {step} expert load"
        for i, grad in got[1][step - 1].items():  # router gradients (the aux loss's too) of this stage's layers
            torch.testing.assert_close(grad, expected[1][step - 1][i], **tol,
                                       msg=f"{dims.coords} step {step} layer {i} router grad")
    for i, b in got[2].items():
        torch.testing.assert_close(b, expected[2][i], rtol=0, atol=0, msg=f"{dims.coords} layer {i} bias")


def test_ep2_matches_single_process(tmp_path):
    expected = _run(str(tmp_path / "one"))
    run_ranks(2, _worker, str(tmp_path / "two"), dict(dp=2, ep=2), {}, expected, EXACT_FP32)


@pytest.mark.parametrize("zero", [0, 1, 3], ids=["replicated", "zero1", "zero3"])
def test_ep2_x_cp2_matches_single_process(tmp_path, zero):
    """dp 2 x cp 2, ep 2 (ep == dp: the experts' replicas are the cp group). The balance loss sums its counts
    over cp (MoE.token_split); zero 1 and zero 3 shard the expert rows over expert-dp x cp, the rest over dp x cp."""
    expected = _run(str(tmp_path / "one"))
    run_ranks(4, _worker, str(tmp_path / "four"), dict(dp=2, cp=2, ep=2), dict(zero=zero), expected, TP_FP32)


@pytest.mark.slow
@pytest.mark.parametrize("degrees, parallel, tol", [
    (dict(dp=4, ep=4), {}, EXACT_FP32),
    (dict(dp=4, ep=2), {}, EXACT_FP32),  # expert-dp 2 without ZeRO: the experts' own gradient all-reduce
    (dict(dp=4, ep=2), dict(zero=2), EXACT_FP32),  # expert-dp 2: experts reduce and shard over it
    (dict(dp=2, ep=2, tp=2), {}, TP_FP32),
    (dict(dp=2, ep=2, tp=2), dict(sequence_parallel=True), TP_FP32),  # each tp rank dispatches all of T
    (dict(dp=2, ep=2, pp=2), dict(zero=1, microbatches=2, schedule="1f1b"), EXACT_FP32),  # router grads, aux on
    (dict(dp=2, ep=2), dict(recompute="full"), EXACT_FP32),  # the all-to-alls run again inside backward
    (dict(dp=2, ep=2), dict(fused_loss=True), EXACT_FP32),  # the head applied inside the loss
    # expert-dp 2 x cp 2: the experts' own dims.expert_dp_cp_group, for the all-reduce and for ZeRO 2's shards
    (dict(dp=4, cp=2, ep=2), {}, TP_FP32),
    (dict(dp=4, cp=2, ep=2), dict(zero=2), TP_FP32),
    (dict(dp=2, cp=2, ep=2, tp=2), dict(sequence_parallel=True), TP_FP32),  # each tp rank dispatches all of T/cp
    (dict(dp=2, cp=2, ep=2, pp=2), dict(zero=1, microbatches=2, schedule="1f1b"), TP_FP32),
], ids=["ep4", "ep2-dp4", "ep2-dp4-zero2", "ep2-tp2", "ep2-tp2-sp", "ep2-pp2-1f1b-zero1", "ep2-recompute-full",
        "ep2-fused-loss", "ep2-dp4-cp2", "ep2-dp4-cp2-zero2", "ep2-cp2-tp2-sp", "ep2-cp2-pp2-1f1b-zero1"])
def test_ep_layouts_match_single_process(tmp_path, degrees, parallel, tol):
    expected = _run(str(tmp_path / "one"), **{k: v for k, v in parallel.items() if k != "zero"})
    world = degrees["dp"] * degrees.get("tp", 1) * degrees.get("pp", 1) * degrees.get("cp", 1)
    run_ranks(world, _worker, str(tmp_path / "many"), degrees, parallel, expected, tol)


def _skewed_worker(rank, world_size, x, want_y, want_grads):
    """Every token routed to experts 0 and 1 (ep rank 0's): rank 1 receives nothing, yet every row is computed."""
    dims = ParallelDims.from_degrees(dp=2, ep=2)
    model = materialize(build(MOE, device="meta"), MOE, seed=0, device="cpu")
    _skew(model)
    apply_expert_parallel(model, dims)
    moe = moe_layers(model)[0]
    mine = x.chunk(2)[dims.dp_rank].clone().requires_grad_(True)
    y = moe(mine)
    torch.testing.assert_close(y, want_y.chunk(2)[dims.dp_rank], **EXACT_FP32)
    y.square().sum().backward()
    torch.testing.assert_close(mine.grad, want_grads["x"].chunk(2)[dims.dp_rank], **EXACT_FP32)
    lo = dims.ep_rank * 2  # the expert gradient summed over the ep group's tokens (ep == dp: no expert-dp)
    for name in ("gate", "up", "down"):
        grad = getattr(moe.experts, name).grad
        assert grad is not None, f"{dims.coords} {name} has no gradient"
        torch.testing.assert_close(grad, want_grads[name][lo:lo + 2], **EXACT_FP32, msg=f"{dims.coords} {name}")
    assert moe.router.step_counts.tolist() == [4, 4, 0, 0], f"{dims.coords} routed rows per expert"


def _skew(model):
    """Uniform router probabilities: the stable top-2 picks experts 0 and 1 for every token."""
    with torch.no_grad():
        for moe in moe_layers(model).values():
            moe.router.weight.zero_()


def test_skewed_routing_drops_no_token(tmp_path):
    model = materialize(build(MOE, device="meta"), MOE, seed=0, device="cpu")
    _skew(model)
    moe = moe_layers(model)[0]
    moe.train()
    x = torch.randn(2, 4, MOE.d_model, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    y = moe(x)
    y.square().sum().backward()
    grads = {"x": x.grad} | {n: getattr(moe.experts, n).grad for n in ("gate", "up", "down")}
    assert grads["gate"][2:].abs().sum() == 0  # experts 2 and 3 (ep rank 1's) see no token
    run_ranks(2, _skewed_worker, x.detach(), y.detach(), grads)


def _resume_worker(rank, world_size, out, ckpt, ep, steps, cp=1, zero=1):
    """ep 2: train, save after 2 steps, go on; any ep: resume from ckpt. Returns (loss, grad norm) of each step
    after step 2 (the norm of step 4 reads the moments restored for step 3's update)."""
    dims = ParallelDims.from_degrees(dp=world_size // cp, cp=cp, ep=ep)
    os.makedirs(out, exist_ok=True)
    trainer = build_trainer(MOE, out, dims, steps=steps, global_batch=4, seq_len=16, ep=ep, zero=zero, resume=ckpt)
    losses = []
    while trainer.step < steps:
        record = trainer.train_step()
        if trainer.step > 2:
            losses.append((record["loss"], record["grad_norm"]))
        if trainer.step == 2 and ckpt is None:
            trainer.checkpointer.save(trainer)
    return losses


@pytest.mark.slow
def test_checkpoint_at_ep2_resumes_at_ep4_and_ep1(tmp_path):
    out = str(tmp_path / "ep2")
    want = rank_results(2, _resume_worker, out, None, 2, 4)[0]
    ckpt = os.path.join(out, "checkpoints", "step-00000002")
    got4 = rank_results(4, _resume_worker, str(tmp_path / "ep4"), ckpt, 4, 4)[0]
    got1 = _resume_worker(0, 1, str(tmp_path / "ep1"), ckpt, 1, 4)
    torch.testing.assert_close(got4, want, **EXACT_FP32)
    torch.testing.assert_close(got1, want, **EXACT_FP32)


@pytest.mark.slow
def test_checkpoint_at_ep2_x_cp2_resumes_at_cp2_and_in_one_process(tmp_path):
    """ZeRO 1 under cp 2 x ep 2 writes its expert moments as expert-dp x cp row boxes: they load at the same
    layout (the uninterrupted run's next steps) and without cp or ep."""
    out = str(tmp_path / "cp2")
    want = rank_results(4, _resume_worker, out, None, 2, 4, 2)[0]
    ckpt = os.path.join(out, "checkpoints", "step-00000002")
    again = rank_results(4, _resume_worker, str(tmp_path / "again"), ckpt, 2, 4, 2)[0]
    got1 = _resume_worker(0, 1, str(tmp_path / "ep1"), ckpt, 1, 4)
    torch.testing.assert_close(again, want, **EXACT_FP32)
    torch.testing.assert_close(got1, want, **TP_FP32)  # cp's attention sums in another order


def _reference(out, model=MOE, **parallel):
    """One process: per step the metrics and every (clipped) gradient; then the weights and the biases."""
    os.makedirs(out, exist_ok=True)
    trainer = build_trainer(model, out, steps=STEPS, global_batch=4, seq_len=16, **parallel)
    history, grads = [], []
    for _ in range(STEPS):
        record = trainer.train_step()
        history.append({k: record[k] for k in KEYS + ("expert_load_max",)})
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    bias = {i: m.router.expert_bias.clone() for i, m in moe_layers(trainer.model).items()}
    return history, grads, params, bias


def _box(t: torch.Tensor, offsets, shape) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(offsets, shape))]


def _zero3_worker(rank, world_size, out, degrees, parallel, model, expected, tol):
    """ep x expert-dp ZeRO-3 against one process: metrics, each part's gradient rows, weights, bytes, resume."""
    history, grads, params, bias = expected
    dims = ParallelDims.from_degrees(**degrees)
    keys = dict(steps=STEPS, global_batch=4, seq_len=16, zero=3, ep=dims.ep, **parallel)
    trainer = build_trainer(model, out, dims, **keys)
    opt = trainer.optimizer
    assert isinstance(opt, ExpertZero3Optimizer), type(opt)
    assert (opt.dense.dp_size, opt.experts.dp_size) == (dims.dp, dims.expert_dp), "shard groups: dp, expert-dp"
    parts = [(part, i) for part in opt.parts for i in range(len(part.params))]
    held = []
    for block in trainer.model.layers.values():
        block.register_forward_pre_hook(lambda m, a: held.append(
            sum(part.gatherer.target(i).untyped_storage().nbytes() for part, i in parts)))
    assert all(p.untyped_storage().nbytes() == 0 for p in opt.experts.params), "experts held whole between units"
    losses = []
    for step in range(STEPS):
        got = trainer.train_step()
        losses.append(got["loss"])
        for key in KEYS:
            torch.testing.assert_close(got[key], history[step][key], **tol, msg=f"{dims.coords} step {step + 1} {key}")
        assert got["expert_load_max"] == history[step]["expert_load_max"], f"{dims.coords} step {step + 1} load"
        for part in opt.parts:  # the reduce-scatter over each part's group left this rank its rows of the sum
            for i, g in part._grad_shards.items():
                shard = part.shards[i]
                want = _box(grads[step][shard.name], *shard.box(part.dp_rank))
                torch.testing.assert_close(g, want, **tol, msg=f"{dims.coords} step {step + 1} {shard.name}")
        if step == STEPS - 2:
            trainer.checkpointer.save(trainer)
    full = opt.full_params()
    for name, (_, slices) in param_layout(trainer.model).items():
        torch.testing.assert_close(full[name], params[name][slices], **AFTER_ADAM, msg=f"{dims.coords} {name}")
    for i, m in moe_layers(trainer.model).items():
        torch.testing.assert_close(m.router.expert_bias, bias[i], rtol=0, atol=0, msg=f"{dims.coords} bias {i}")
    p = trainer.recipe.parallel
    if p.reshard_after_forward and p.recompute == "none" and model.lora_rank is None:  # (the model leaves adapters out)
        unit = zero3_unit_bytes(trainer.recipe, dims.pp_rank)[1]  # one block: its dense weights and E/ep experts
        assert sorted(set(held)) == [unit], (held, unit)
    if model.lora_rank is None:
        modeled = model_state_bytes(trainer.recipe, world_size, dims.pp_rank)[2]  # dp rank 0's: the most rows
        assert opt.state_bytes() == modeled if dims.dp_rank == 0 else opt.state_bytes() <= modeled
    resumed = build_trainer(model, out, dims, resume="auto", **keys)
    assert resumed.train_step()["loss"] == losses[-1], "an ep + zero 3 checkpoint resumes exactly"
    again = resumed.optimizer.full_params()
    assert all(torch.equal(again[n], full[n]) for n in full), f"{dims.coords} resumed weights differ"


def _zero3_matches_single_process(tmp_path, degrees, parallel, model=MOE, tol=EXACT_FP32):
    expected = _reference(str(tmp_path / "one"), model, **parallel)
    out = str(tmp_path / "ep")
    os.makedirs(out)
    world = degrees["dp"] * degrees.get("tp", 1) * degrees.get("pp", 1)
    run_ranks(world, _zero3_worker, out, degrees, parallel, model, expected, tol)
    # the ep x zero 3 checkpoint (row boxes of both parts) loads into one process: the same next loss
    os.makedirs(tmp_path / "one_resumed")
    one = build_trainer(model, str(tmp_path / "one_resumed"), steps=STEPS, global_batch=4, seq_len=16,
                        resume=os.path.join(out, "checkpoints", "step-00000002"), **parallel)
    torch.testing.assert_close(one.train_step()["loss"], expected[0][-1]["loss"], **tol)


def test_ep2_zero3_gathers_experts_over_expert_dp_and_matches_single_process(tmp_path):
    _zero3_matches_single_process(tmp_path, dict(dp=4, ep=2), {})  # expert-dp 2: experts over 2 ranks, the rest 4


TWO_EXPERTS = dataclasses.replace(MOE, num_experts=2, num_experts_per_tok=1)
MOE_LORA = dataclasses.replace(MOE, lora_rank=4, lora_alpha=8.0)  # attention adapters; the experts frozen, sharded


@pytest.mark.slow
@pytest.mark.parametrize("degrees, parallel, model, tol", [
    (dict(dp=2, ep=2), {}, MOE, EXACT_FP32),  # expert-dp 1: each ep rank the only holder of its experts
    (dict(dp=4, ep=2), {}, TWO_EXPERTS, EXACT_FP32),  # one local expert over expert-dp 2: half the ranks hold none
    (dict(dp=2, ep=2, tp=2), dict(sequence_parallel=True), MOE, TP_FP32),
    (dict(dp=2, ep=2, pp=2), dict(microbatches=2, schedule="1f1b"), MOE, EXACT_FP32),
    (dict(dp=4, ep=2), dict(reshard_after_forward=False, recompute="full"), MOE, EXACT_FP32),
    (dict(dp=2, ep=2), dict(fused_loss=True), MOE, EXACT_FP32),  # the head gathered around the loss
    (dict(dp=4, ep=2), {}, MOE_LORA, EXACT_FP32),
], ids=["ep2-dp2", "ep2-dp4-empty-rows", "ep2-tp2-sp", "ep2-pp2-1f1b", "ep2-dp4-keep-gathered-recompute",
        "ep2-fused-loss", "ep2-dp4-lora"])
def test_ep_zero3_layouts_match_single_process(tmp_path, degrees, parallel, model, tol):
    _zero3_matches_single_process(tmp_path, degrees, parallel, model, tol)


def _bf16_losses(rank, world_size, out, zero):
    dims = ParallelDims.from_degrees(dp=world_size, ep=2)
    os.makedirs(os.path.join(out, f"zero{zero}"), exist_ok=True)
    trainer = build_trainer(MOE, os.path.join(out, f"zero{zero}"), dims, steps=STEPS, global_batch=4, seq_len=16,
                            zero=zero, ep=2, precision="bf16")
    return [trainer.train_step()["loss"] for _ in range(STEPS)]


@pytest.mark.slow
def test_ep2_zero3_bf16_matches_zero1(tmp_path):
    """bf16: zero 3 gathers the dense linears in bf16 and the experts in fp32 (parallel/data/zero3.py), the values
    zero 1's autocast computes with: the same losses within fp32 round-off."""
    one, three = (rank_results(4, _bf16_losses, str(tmp_path / f"z{zero}"), zero)[0] for zero in (1, 3))
    torch.testing.assert_close(three, one, **EXACT_FP32)


def _lora_losses(rank, world_size, out, zero):
    dims = ParallelDims.from_degrees(dp=world_size, ep=2) if world_size > 1 else None
    keys = dict(zero=zero, ep=2) if dims else {}
    trainer = build_trainer(MOE_LORA, os.path.join(out, f"zero{zero}"), dims, steps=STEPS, global_batch=4,
                            seq_len=16, **keys)
    return [trainer.train_step()["loss"] for _ in range(STEPS)]


@pytest.mark.parametrize("zero", [1, 2])
def test_ep2_lora_with_zero_1_or_2_matches_single_process(tmp_path, zero):
    """LoRA freezes the experts, so ZeRO's expert part owns no trainable parameter: its clipping sum took the
    device of its first parameter and crashed (IndexError). Now it trains as one process."""
    for run in (f"zero{zero}", "one/zero0"):
        os.makedirs(tmp_path / run)
    one = _lora_losses(0, 1, str(tmp_path / "one"), 0)
    ep2 = rank_results(2, _lora_losses, str(tmp_path), zero)[0]
    torch.testing.assert_close(ep2, one, **EXACT_FP32)


@pytest.mark.slow
def test_checkpoint_of_ep2_zero3_resumes_under_zero1_at_ep2_and_ep4(tmp_path):
    """ZeRO-3 under ep writes both parts' parameter rows and moments as row boxes of the global tensors: zero 1
    at ep 2 and at ep 4 resumes from them with the uninterrupted zero 3 run's losses and norms."""
    want = rank_results(4, _resume_worker, str(tmp_path / "zero3"), None, 2, 4, 1, 3)[0]
    ckpt = os.path.join(str(tmp_path / "zero3"), "checkpoints", "step-00000002")
    for ep in (2, 4):
        got = rank_results(4, _resume_worker, str(tmp_path / f"zero1-ep{ep}"), ckpt, ep, 4, 1, 1)[0]
        torch.testing.assert_close(got, want, **EXACT_FP32, msg=lambda m: f"zero 1 at ep {ep}: {m}")
