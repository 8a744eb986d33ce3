"""Memory features in one process: ZeRO row sharding arithmetic and bucket overlap (dp = 1), optimizer
state round trips, bf16 autocast with fp32 master weights, and activation recomputation (identical
numbers, really recomputed, fewer bytes saved for backward).

Trainers come from pipetrain.build.build_trainer on synthetic tokens (tests/unit/common.py), as the
distributed tests (tests/dist/test_zero.py) build theirs.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from pipetrain.config import ParallelConfig
from pipetrain.models import build, materialize
from pipetrain.optim.build import Optimizer
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.pipeline.stage import build_stage
from pipetrain.parallel.pipeline.recompute import apply_recompute
from pipetrain.parallel.data.zero import MAX_IN_FLIGHT, ParamShard, ZeroOptimizer, dp_row_ranges
from tests.unit.common import BF16_LOSS, GPT2, LLAMA, build_trainer, read_from, zero_formula_bytes


# ---- ZeRO arithmetic ----

@pytest.mark.parametrize("rows,dp", [(8, 2), (66, 4), (17, 4), (3, 4), (1, 2), (0, 2)])
def test_dp_row_ranges_follow_tensor_split_including_fewer_rows_than_dp(rows, dp):
    x = torch.arange(rows)
    expected = [(int(c[0]) if len(c) else None, len(c)) for c in torch.tensor_split(x, dp)]
    ranges = dp_row_ranges(rows, dp)
    assert [e - s for s, e in ranges] == [n for _, n in expected]
    assert ranges[0][0] == 0 and ranges[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), ranges


def test_shard_box_composes_tp_slice_with_dp_rows():
    # a column-parallel weight: tp rank 1 of 2 holds global rows 33..65 of (66, 40); dp 2 splits its 33 rows 17/16
    column = ParamShard("head.weight", (66, 40), (33, 0), (33, 40), tuple(dp_row_ranges(33, 2)))
    assert column.box(0) == ((33, 0), (17, 40)) and column.box(1) == ((50, 0), (16, 40))
    # a row-parallel weight: tp rank 1 holds global columns 32..63 of (40, 64); dp splits rows only
    row = ParamShard("layers.0.mlp.down.weight", (40, 64), (0, 32), (40, 32), tuple(dp_row_ranges(40, 4)))
    assert [row.box(r) for r in range(4)] == [((10 * r, 32), (10, 32)) for r in range(4)]
    assert sum(row.numel(r) for r in range(4)) == 40 * 32


# ---- optimizers in one process ----

def _state_of(optimizer) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t, _, _ in optimizer.state_items()}


def test_zero_optimizer_at_dp1_steps_exactly_like_adamw(tmp_path):
    """One dp rank exercises buckets, overlap and clipping with no communication: bitwise zero 0."""
    runs = {}
    for zero in (0, 1, 2):
        trainer = build_trainer(LLAMA, str(tmp_path), zero=zero, bucket_bytes=4096 if zero else None,
                                microbatches=2, grad_clip=0.05)
        records = [trainer.train_step() for _ in range(3)]
        runs[zero] = ([r["loss"] for r in records], [r["grad_norm"] for r in records],
                      {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, trainer.optimizer)
    assert isinstance(runs[2][3], ZeroOptimizer) and len(runs[2][3].buckets) > 3, "several buckets expected"
    assert runs[0][1][0] > 0.05, "clipping must be active for this test to mean anything"
    for zero in (1, 2):
        assert runs[zero][0] == runs[0][0] and runs[zero][1] == runs[0][1], zero
        for name, p in runs[0][2].items():
            assert torch.equal(runs[zero][2][name], p), f"zero {zero}: {name} differs"
        assert runs[zero][3].state_bytes() == runs[0][3].state_bytes() == zero_formula_bytes(runs[zero][3])


def test_overlap_launches_buckets_only_during_the_last_microbatch_backward(tmp_path):
    trainer = build_trainer(LLAMA, str(tmp_path), zero=2, bucket_bytes=4096, microbatches=2)
    trainer.train_step()  # the first step learns how many accumulations a step has
    opt, model = trainer.optimizer, trainer.model
    batch, num_targets = trainer.loader.next()
    opt.zero_grad()
    for k, mb in enumerate(batch.split(2)):
        loss = F.cross_entropy(model(mb.inputs).flatten(0, 1), mb.targets.flatten(), reduction="sum")
        (loss / num_targets).backward()
        launched = opt._next_launch
        assert launched == (0 if k == 0 else opt.num_early), (k, launched, opt.num_early)
    assert len(opt._in_flight) <= MAX_IN_FLIGHT, "the reduction holds at most two bucket buffers at once"
    # stage 2 frees each launched bucket's full gradients while backward still runs
    assert all(p.grad is None for b in opt.buckets[:opt.num_early] for i in b.members for p in [opt.params[i]])
    opt.reduce_grads()
    assert opt.grad_bytes() == sum(4 * b.part for b in opt.buckets)


def test_more_backward_passes_than_the_first_step_raise(tmp_path):
    trainer = build_trainer(LLAMA, str(tmp_path), zero=1, bucket_bytes=4096)
    trainer.train_step()
    trainer.optimizer.zero_grad()
    x = torch.randint(0, 64, (2, 16))
    trainer.model(x).sum().backward()
    with pytest.raises(RuntimeError, match="accumulated 2 times this step but 1 times"):
        trainer.model(x).sum().backward()


def test_optimizer_state_items_round_trip_resumes_bitwise(tmp_path):
    for cfg in (LLAMA, GPT2):
        a = build_trainer(cfg, str(tmp_path))
        for _ in range(2):
            a.train_step()
        items = a.optimizer.state_items()
        names = {n for n, _, _, _ in items}
        assert "step" in names and all(f"exp_avg_sq/{n}" in names for n, _ in a.model.named_parameters())
        assert all(off == tuple(0 for _ in shape) for _, _, shape, off in items), "one process: whole tensors"
        b = build_trainer(cfg, str(tmp_path))
        with torch.no_grad():
            for pa, pb in zip(a.model.parameters(), b.model.parameters()):
                pb.copy_(pa)
        b.optimizer.load_state_items(read_from(items))
        b.step = a.step
        b.loader.samples = a.loader.samples
        assert b.optimizer.steps_taken == 2 and b.optimizer.state_bytes() == a.optimizer.state_bytes()
        ra, rb = a.train_step(), b.train_step()
        assert ra["loss"] == rb["loss"]
        for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
            assert torch.equal(pa, pb), f"{cfg.family} {name} differs after resuming"


def test_zero0_state_bytes_are_two_fp32_moments_per_parameter(tmp_path):
    trainer = build_trainer(LLAMA, str(tmp_path))
    assert isinstance(trainer.optimizer, Optimizer) and trainer.optimizer.state_bytes() == 0
    trainer.train_step()
    assert trainer.optimizer.state_bytes() == 2 * 4 * sum(p.numel() for p in trainer.model.parameters())


# ---- bf16 mixed precision ----

def test_bf16_first_loss_is_within_bf16_tolerance_of_fp32_and_keeps_fp32_master_weights(tmp_path):
    fp32 = build_trainer(LLAMA, str(tmp_path), learnable=True).train_step()["loss"]
    trainer = build_trainer(LLAMA, str(tmp_path), precision="bf16", learnable=True)
    bf16 = trainer.train_step()["loss"]
    torch.testing.assert_close(bf16, fp32, **BF16_LOSS)
    assert bf16 != fp32, "autocast did not change the computation"
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert all(t.dtype == torch.float32 for _, t, _, _ in trainer.optimizer.state_items() if t.dim())


def test_bf16_run_learns_a_cycle(tmp_path):
    trainer = build_trainer(LLAMA, str(tmp_path), precision="bf16", learnable=True, steps=8, lr=3e-2)
    losses = [trainer.train_step()["loss"] for _ in range(8)]
    assert losses[-1] < 0.65 * losses[0], losses


# ---- activation recomputation ----

def _recompute_run(cfg, mode, precision="fp32", **kw):
    """loss, grads, and (bytes saved for backward outside checkpointed regions) for one fwd+bwd."""
    model = materialize(build(cfg), cfg, 1, "cpu")
    names = apply_recompute(model, ParallelConfig(recompute=mode, **kw))
    x = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), x.roll(-1, 1).flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, sum(saved), names


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_recompute_modes_give_bitwise_identical_losses_and_grads(cfg, precision):
    loss, grads, _, _ = _recompute_run(cfg, "none", precision)
    for mode in ("selective", "full"):
        other_loss, other_grads, _, names = _recompute_run(cfg, mode, precision)
        assert names, mode
        assert torch.equal(other_loss, loss), (mode, other_loss, loss)
        for name, g in grads.items():
            assert torch.equal(other_grads[name], g), f"{mode}: grad of {name} differs"


def _count_calls(monkeypatch, cls_or_module, attr):
    calls = {"n": 0}
    original = getattr(cls_or_module, attr)

    def counted(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)
    monkeypatch.setattr(cls_or_module, attr, counted)
    return calls


@pytest.mark.parametrize("mode,mlp_in_backward,attention_in_backward",
                         [("none", 0, 0), ("selective", 0, 2), ("full", 2, 2)])
def test_recompute_reruns_exactly_its_modules_forward_during_backward(monkeypatch, mode, mlp_in_backward,
                                                                      attention_in_backward):
    from pipetrain.models.decoder import MLP
    mlp = _count_calls(monkeypatch, MLP, "forward")
    sdpa = _count_calls(monkeypatch, F, "scaled_dot_product_attention")
    model = materialize(build(LLAMA), LLAMA, 1, "cpu")
    apply_recompute(model, ParallelConfig(recompute=mode))
    loss = model(torch.randint(0, 64, (2, 16))).logsumexp(-1).mean()
    assert (mlp["n"], sdpa["n"]) == (2, 2), "one call per layer in forward"
    loss.backward()
    assert (mlp["n"] - 2, sdpa["n"] - 2) == (mlp_in_backward, attention_in_backward)


def test_recompute_cuts_bytes_saved_for_backward():
    saved = {mode: _recompute_run(LLAMA, mode)[2] for mode in ("none", "selective", "full")}
    assert saved["full"] < 0.2 * saved["none"], saved  # only block inputs and the head/loss remain
    assert saved["selective"] < saved["none"], saved   # the attention core's saved tensors are gone


def test_recompute_layers_limits_full_recompute_to_the_first_blocks(monkeypatch):
    from pipetrain.models.decoder import MLP
    cfg = dataclasses.replace(LLAMA, n_layers=3)
    mlp = _count_calls(monkeypatch, MLP, "forward")
    _, _, _, names = _recompute_run(cfg, "full", recompute_layers=1)
    assert names == ["layers.0"] and mlp["n"] == 3 + 1


def test_tied_head_copy_on_the_last_stage_does_not_decay_like_the_embedding():
    from pipetrain.optim.build import param_groups
    last = ParallelDims(pp=2, rank=1)
    model, _, _ = build_stage(build(GPT2), last, ParallelConfig(pp=2), 16)
    decay, no_decay = param_groups(model, 0.1)
    assert model.embed is None and any(p is model.head.weight for p in no_decay["params"])
    assert all(p is not model.head.weight for p in decay["params"])


def test_recompute_layers_applies_to_each_interleaved_stage_of_a_rank():
    cfg = dataclasses.replace(LLAMA, n_layers=8)
    pcfg = ParallelConfig(pp=2, virtual_stages=2, schedule="interleaved-1f1b", microbatches=2, recompute="full",
                          recompute_layers=1)
    model, _, specs = build_stage(build(cfg), ParallelDims(pp=2, rank=1), pcfg, 16)
    assert [s.layers for s in specs] == [(2, 3), (6, 7)]
    assert apply_recompute(model, pcfg) == ["layers.2", "layers.6"]


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_bf16_autocast_keeps_the_pipeline_boundary_activation_fp32(cfg):
    """The executor sends activations in the parameter dtype (fp32); under autocast the residual
    stream stays fp32 (fp32 embedding + bf16 branch outputs promote to fp32), so P2P agrees."""
    model, chunks, _ = build_stage(build(cfg), ParallelDims(pp=2, rank=0), ParallelConfig(pp=2), 16)
    materialize(model, cfg, 1, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = chunks[0](torch.randint(0, cfg.vocab_size, (2, 16)))
        inner = model.layers["0"].mlp(out)
    assert out.dtype == torch.float32 and inner.dtype == torch.bfloat16


def test_recompute_applied_twice_is_refused():
    model = build(LLAMA)
    apply_recompute(model, ParallelConfig(recompute="selective"))
    with pytest.raises(ValueError, match="apply it once"):
        apply_recompute(model, ParallelConfig(recompute="full"))


def test_recompute_layers_applies_to_each_v_placed_stage_of_a_rank():
    """zbv's last rank holds two adjacent stages (layers 2-3 and 4-5 of 8 on pp 2): consecutive indices, so runs of
    them merged the two and recomputed one block where the pipeline split says two stages of one each."""
    cfg = dataclasses.replace(LLAMA, n_layers=8)
    pcfg = ParallelConfig(pp=2, virtual_stages=2, schedule="zbv", microbatches=4, recompute="full",
                          recompute_layers=1)
    model, _, specs = build_stage(build(cfg), ParallelDims(pp=2, rank=1), pcfg, 16)
    assert [s.layers for s in specs] == [(2, 3), (4, 5)]
    assert apply_recompute(model, pcfg, [s.layers for s in specs]) == ["layers.2", "layers.4"]
