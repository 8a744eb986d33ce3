"""FP8 training (emulated on CPU) under tensor parallelism (pipetrain/parallel/tensor/fp8.py): a tp rank
quantises with the scale of the full tensor (its amax reduced over tp), so tp=2's fp8 operands are bitwise
tp=1's and the results differ by fp32 summation order only. The same for rowwise scales
(train.fp8_recipe=rowwise, fp8_rowwise.py), whose per-row amaxes are reduced over tp where tp splits the row, and for
rowwise_with_gw_hp (dx's weight under one scale: its amax reduced over tp whichever dim tp splits)."""
import json
import os

import pytest
import torch
import torch.nn as nn

from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.tensor.fp8 import Fp8Linear, apply_fp8
from pipetrain.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from tests.harness import TP_FP32, rank_results, run_ranks
from tests.unit.common import LLAMA, build_trainer
from tests.unit.test_fp8_lora import LORA

B, T, D = 2, 8, 32
STEPS = 4
# The first step's forward sees the same fp8 operands in every layout: its loss differs by round-off. Later
# steps follow gradients quantised to e5m2 (2 mantissa bits): where tp's other summation order moves a
# gradient element across a rounding boundary, that element moves by up to a quarter of its value, so the
# curves part by up to a few 1e-4 (measured 6.8e-4 at step 2) and stay within FP8_TP_CURVE.
FP8_TP_FIRST = dict(rel=1e-4, abs=0.0)
FP8_TP_CURVE = dict(rel=5e-3, abs=0.0)


def _check(got, want, what, dims):
    torch.testing.assert_close(got, want, **TP_FP32, msg=lambda m: f"{dims.coords} {what}: {m}")


def _layers_worker(rank, world_size, recipe):
    """Column- and row-parallel fp8 linears against one process's fp8 linear. Rank 0's shards of x, W and
    dy hold values 2^12 (dy: 2^20) times larger than rank 1's, so under the full tensor's scale many of rank
    1's values are fp8 subnormals. (A power-of-two scale changes only which values saturate or fall to
    subnormals; a scale taken per shard would give rank 1 all-normal values, and results tp=1 does not.)
    rowwise: the same holds for the rows that tp splits (x's and W's rows of a row-parallel linear, dy's rows and
    W's columns of a column-parallel one): a scale per row taken from one shard's part of it is not tp=1's.
    rowwise_with_gw_hp: dx's weight scale is the whole weight's, from both shards. A second pattern balances
    dx = dy W (rank 0's dy and rank 1's weight rows 2^12 larger), where the first leaves rank 1's part of it
    2^-20 of rank 0's: there a per-token dy scale taken from one shard (rowwise) would not show."""
    dims = ParallelDims.from_degrees(tp=world_size)
    half, other = slice(0, D // 2), slice(D // 2, D)
    mine = slice(dims.tp_rank * D // 2, (dims.tp_rank + 1) * D // 2)
    for pattern, kind in ((p, k) for p in ("x-and-dy", "dy-balanced") for k in ("column", "row")):
        torch.manual_seed(0)
        x, g, lin = torch.randn(B, T, D), torch.randn(B, T, D), nn.Linear(D, D)
        with torch.no_grad():
            if pattern == "x-and-dy":
                x[..., half] *= 2 ** 12  # row-parallel rank 0's input shard
                g[..., half] *= 2 ** 20  # column-parallel rank 0's output gradient shard (e5m2 reaches 2^-16)
                lin.weight[half, half] *= 2 ** 12  # rank 0's weight shard, by rows (column) or by columns (row)
            else:  # rank 0's dy 2^12 larger, rank 1's weight rows too: both ranks' parts of dx = dy W count, so
                g[..., half] *= 2 ** 12  # a per-token dy scale from one shard (e4m3) shows in dx
                lin.weight[other] *= 2 ** 12
        xr = x.clone().requires_grad_()
        y_ref = Fp8Linear(rowwise=recipe != "tensorwise", weight_grad_hp=recipe == "rowwise_with_gw_hp")(
            xr, lin.weight, lin.bias)
        (y_ref * g).sum().backward()
        if kind == "column":
            layer, xp, out, dy = ColumnParallelLinear.from_linear(lin, dims), x.clone(), mine, g[..., mine]
        else:
            layer, xp, out, dy = RowParallelLinear.from_linear(lin, dims), x[..., mine].clone(), slice(None), g
        # the spec as apply_fp8 gives it to a block's wq (column-parallel) or wo (row-parallel)
        block = nn.Module()
        block.attn = nn.Module()
        name = "wq" if kind == "column" else "wo"
        setattr(block.attn, name, layer)
        assert apply_fp8(nn.ModuleDict({"layers": nn.ModuleList([block])}), dims, LLAMA, emulate=True,
                         recipe=recipe) == [f"layers.0.attn.{name}"]
        xp.requires_grad_()
        y = layer(xp)
        (y * dy).sum().backward()
        what = f"{pattern} {kind}"
        _check(y, y_ref[..., out].detach(), f"{what} output", dims)
        _check(xp.grad, xr.grad if kind == "column" else xr.grad[..., mine], f"{what} input grad", dims)
        w_rows, w_cols = (mine, slice(None)) if kind == "column" else (slice(None), mine)
        _check(layer.weight.grad, lin.weight.grad[w_rows, w_cols], f"{what} weight grad", dims)
        _check(layer.bias.grad, lin.bias.grad[out], f"{what} bias grad", dims)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_fp8_column_and_row_parallel_linears_match_one_process_at_tp2(recipe):
    run_ranks(2, _layers_worker, recipe)


def _losses(out: str, dims: ParallelDims | None = None, model=LLAMA, **keys) -> list[float]:
    os.makedirs(out, exist_ok=True)
    trainer = build_trainer(model, out, dims, precision="fp8", steps=STEPS, learnable=True, **keys)
    # every block linear of this stage is fp8, with its amaxes reduced over this rank's tp group
    specs = [m.fp8 for m in trainer.model.modules() if getattr(m, "fp8", None) is not None]
    layers = len(trainer.model.layers)
    assert len(specs) == 7 * layers and layers > 0, f"{len(specs)} fp8 linears in {layers} layers"
    tp_group = dims.tp_group if dims is not None and dims.tp > 1 else None
    assert all(spec.tp_group is tp_group for spec in specs), "an fp8 linear does not reduce its amax over tp"
    trainer.fit()
    if dims is not None and dims.rank != 0:
        return []
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f if '"loss"' in line]


def _trainer_worker(rank, world_size, out, tp, pp, keys):
    return _losses(os.path.join(out, "run"), ParallelDims.from_degrees(tp=tp, pp=pp), **keys)


def _dp_worker(rank, world_size, out, keys):
    return _losses(os.path.join(out, "run"), ParallelDims.from_degrees(dp=world_size), **keys)


def _check_curve(losses, reference):
    assert len(losses) == len(reference) == STEPS
    assert losses[0] == pytest.approx(reference[0], **FP8_TP_FIRST), f"step 1: {losses} against tp=1's {reference}"
    assert losses == pytest.approx(reference, **FP8_TP_CURVE), f"{losses} against tp=1's {reference}"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise",
                                    pytest.param("rowwise_with_gw_hp", marks=pytest.mark.slow)])
def test_fp8_trainer_at_tp2_follows_the_single_process_run(tmp_path, recipe):
    reference = _losses(str(tmp_path / "single"), fp8_recipe=recipe)
    _check_curve(rank_results(2, _trainer_worker, str(tmp_path), 2, 1, dict(fp8_recipe=recipe))[0], reference)


def _counting_fp8_calls(run, *args):
    """run(*args), and how many times a projection's own forward called its Fp8Linear (the linears of one input
    go through fp8_linears instead: wo and down are the ones counted)."""
    calls = []
    real = Fp8Linear.__call__
    Fp8Linear.__call__ = lambda self, *a: calls.append(1) or real(self, *a)
    try:
        return run(*args), len(calls)
    finally:
        Fp8Linear.__call__ = real


def _lora_worker(rank, world_size, out, keys):
    return _counting_fp8_calls(_trainer_worker, rank, world_size, out, world_size, 1, keys)


def test_fp8_lora_at_tp2_follows_the_single_process_run(tmp_path):
    """LoRA's frozen fp8 bases: the row-parallel ones (wo, down) add their adapter's partial sum before the tp
    reduction (parallel/tensor/lora.py), the column-parallel ones after the fp8 base, as at tp=1: the same fp8
    calls of wo and down per step, and the curve."""
    keys = dict(model=LORA, sequence_parallel=True)
    reference, reference_calls = _counting_fp8_calls(_losses, str(tmp_path / "single"), None, LORA)
    losses, calls = rank_results(2, _lora_worker, str(tmp_path), keys)[0]
    assert calls == reference_calls == 2 * LORA.n_layers * STEPS, (calls, reference_calls)
    _check_curve(losses, reference)


@pytest.mark.slow
def test_fp8_trainer_at_pp2_x_tp2_with_sequence_parallel_follows_the_single_process_run(tmp_path):
    reference = _losses(str(tmp_path / "single"), microbatches=2)
    keys = dict(microbatches=2, sequence_parallel=True)
    _check_curve(rank_results(4, _trainer_worker, str(tmp_path), 2, 2, keys)[0], reference)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_fp8_trainer_at_pp2_with_split_backward_equals_the_single_process_run(tmp_path, recipe):
    """pp changes no microbatch and no summation order: the fp8 losses are the single process's, bit for bit
    (the fp8 linears compute dW in B, so the split backward's W actions find nothing of theirs to do)."""
    reference = _losses(str(tmp_path / "single"), microbatches=4, fp8_recipe=recipe)
    keys = dict(microbatches=4, split_backward=True, fp8_recipe=recipe)
    assert rank_results(2, _trainer_worker, str(tmp_path), 1, 2, keys)[0] == reference


@pytest.mark.slow
def test_fp8_trainer_at_dp2_with_zero2_equals_one_process_with_two_microbatches(tmp_path):
    """Scales are per microbatch: dp=2 (4 sequences a rank) quantises as one process with 2 microbatches of 4,
    so the first step's loss is the same bit for bit. Later steps: ZeRO's gradient norm sums each rank's
    shard apart, in another order than the single process's, and the clip acts here (norms of 1.05 to 1.2
    against train.grad_clip 1.0), so the updates differ by round-off, which e5m2 gradients then amplify as
    tp's summation order does (FP8_TP_CURVE)."""
    reference = _losses(str(tmp_path / "single"), microbatches=2)
    losses = rank_results(2, _dp_worker, str(tmp_path), dict(zero=2))[0]
    assert losses[0] == reference[0]
    _check_curve(losses, reference)
