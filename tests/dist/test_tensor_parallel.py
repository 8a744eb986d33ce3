"""Tensor, sequence and data parallelism on gloo CPU processes, against the same model in one process.

Each case spawns processes (several seconds each on the shared CPU machine), so one spawn checks one
feature at one world size; the full family x tp x sequence-parallel matrix is marked slow.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from pipetrain.config import ModelConfig
from pipetrain.kernels import cross_entropy
from pipetrain.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from pipetrain.models import build, materialize, param_layout
from pipetrain.parallel.mesh import comm
from pipetrain.parallel.data.allreduce import allreduce_grads, grad_buckets
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.tensor.layers import (ColumnParallelLinear, ReplicatedKVLinear, RowParallelLinear,
                                              VocabParallelEmbedding, apply_tensor_parallel, sync_tp_partial_grads,
                                              tp_partial_params)
from tests.harness import EXACT_FP32, TP_FP32, run_ranks

SEED = 1234
B, T = 2, 16
CASES = {  # tiny models; the comment says what each exercises
    "llama_gqa": ModelConfig(family="llama", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                             ffn_hidden=64, max_seq_len=32),  # kv heads split at tp 2, replicated at tp 4
    "llama_mha": ModelConfig(family="llama", vocab_size=64, d_model=32, n_layers=2, n_heads=4,
                             ffn_hidden=64, max_seq_len=32),  # kv heads split at tp 2 and 4
    "qwen2_mqa": ModelConfig(family="qwen2", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1,
                             ffn_hidden=64, max_seq_len=32),  # one kv head with bias, replicated
    "gpt2": ModelConfig(family="gpt2", vocab_size=64, d_model=32, n_layers=2, n_heads=4,
                        max_seq_len=32),  # tied embeddings, position embedding, biases, LayerNorm
}


def _check(actual, expected, what, dims=None, tol=TP_FP32):
    where = dims.coords if dims is not None else ""
    torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{where} {what}: {m}")


def _build(cfg, dims=None, sequence_parallel=False):
    """meta -> (tensor parallel) -> materialize, as the trainer does."""
    model = build(cfg)
    if dims is not None:
        apply_tensor_parallel(model, dims, sequence_parallel=sequence_parallel)
    materialize(model, cfg, SEED, "cpu")
    return model


def _batch(cfg, batch=B):
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (batch, T), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (batch, T), generator=gen)
    targets[0, :3] = -100  # ignored targets must not tilt the mean
    return tokens, targets


def _reference_grads(cfg, tokens, targets):
    model = _build(cfg)
    loss = cross_entropy(model(tokens), targets)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
    return loss.detach(), grads, set(param_layout(model))


def _compare_grads(model, ref_grads, dims, tol=TP_FP32):
    """Every local (shard of a) gradient equals its slice of the single-process gradient."""
    params = dict(model.named_parameters(remove_duplicate=False))
    layout = param_layout(model)
    assert layout, f"{dims.coords} model has no parameters"
    for name, (shape, slices) in layout.items():
        assert shape == tuple(ref_grads[name].shape), f"{dims.coords} {name}: global shape {shape}"
        _check(params[name].grad, ref_grads[name][slices], f"grad of {name}", dims, tol)


# ---- per-layer parity ----

def _layers_worker(rank, world_size):
    dims = ParallelDims.from_degrees(tp=world_size)
    tp_rank, tp_group = dims.tp_rank, dims.tp_group
    torch.manual_seed(0)  # same full weights and inputs on every rank
    d_in, d_out, V = 8 * world_size, 4 * world_size, 16 * world_size
    cols = slice(tp_rank * d_out // world_size, (tp_rank + 1) * d_out // world_size)
    ins = slice(tp_rank * d_in // world_size, (tp_rank + 1) * d_in // world_size)
    rows_t = slice(tp_rank * T // world_size, (tp_rank + 1) * T // world_size)
    x = torch.randn(B, T, d_in)
    for sp in (False, True):
        # column: the loss is the sum over ranks of each rank's shard of sum(y * g)
        lin = nn.Linear(d_in, d_out)
        g = torch.randn(B, T, d_out)
        xr = x.clone().requires_grad_()
        (lin(xr) * g).sum().backward()
        col = ColumnParallelLinear.from_linear(lin, dims, sequence_parallel=sp)
        xp = (x[:, rows_t] if sp else x).clone().requires_grad_()
        y = col(xp)
        _check(y, lin(x)[..., cols].detach(), f"column sp={sp} output", dims)
        (y * g[..., cols]).sum().backward()
        _check(xp.grad, xr.grad[:, rows_t] if sp else xr.grad, f"column sp={sp} input grad", dims)
        _check(col.weight.grad, lin.weight.grad[cols], f"column sp={sp} weight grad", dims)
        _check(col.bias.grad, lin.bias.grad[cols], f"column sp={sp} bias grad", dims)
        # row: input sharded along D_in, output summed (and reduce-scattered along T under sp)
        lin = nn.Linear(d_in, d_out)
        g = torch.randn(B, T, d_out)
        xr = x.clone().requires_grad_()
        (lin(xr) * g).sum().backward()
        row = RowParallelLinear.from_linear(lin, dims, sequence_parallel=sp)
        xp = x[..., ins].clone().requires_grad_()
        y = row(xp)
        _check(y, (lin(x)[:, rows_t] if sp else lin(x)).detach(), f"row sp={sp} output", dims)
        # without sp every rank holds the whole output, so each rank's loss is the whole loss
        (y * (g[:, rows_t] if sp else g)).sum().backward()
        sync_tp_partial_grads(row, dims)
        assert [n for n, _ in tp_partial_params(row)] == (["bias"] if sp else [])
        _check(xp.grad, xr.grad[..., ins], f"row sp={sp} input grad", dims)
        _check(row.weight.grad, lin.weight.grad[:, ins], f"row sp={sp} weight grad", dims)
        _check(row.bias.grad, lin.bias.grad, f"row sp={sp} bias grad", dims)
        # vocab embedding: each rank's rows, summed (reduce-scattered along T under sp)
        emb = nn.Embedding(V, d_out)
        ids = torch.randint(0, V, (B, T))
        g = torch.randn(B, T, d_out)
        (emb(ids) * g).sum().backward()
        vpe = VocabParallelEmbedding.from_embedding(emb, dims, sequence_parallel=sp)
        y = vpe(ids)
        _check(y, (emb(ids)[:, rows_t] if sp else emb(ids)).detach(), f"vocab embedding sp={sp} output", dims)
        (y * (g[:, rows_t] if sp else g)).sum().backward()
        vrows = slice(tp_rank * V // world_size, (tp_rank + 1) * V // world_size)
        _check(vpe.weight.grad, emb.weight.grad[vrows], f"vocab embedding sp={sp} weight grad", dims)
    # vocab-parallel cross-entropy against F.cross_entropy, never gathering the logits
    logits = torch.randn(B, T, V, requires_grad=True)
    targets = torch.randint(0, V, (B, T))
    targets[1, 2:5] = -100
    ref = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ignore_index=-100)
    ref.backward()
    vrows = slice(tp_rank * V // world_size, (tp_rank + 1) * V // world_size)
    shard = logits.detach()[..., vrows].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, targets, -100, tp_group)
    loss.backward()
    _check(loss, ref.detach(), "vocab-parallel cross-entropy", dims)
    _check(shard.grad, logits.grad[..., vrows], "vocab-parallel cross-entropy grad", dims)
    # the all_reduce + slice fallback for backends without reduce_scatter gives the same result
    z = torch.randn(B, T, 3) * (tp_rank + 1)
    native = comm.reduce_scatter(z, 1, tp_group, native=True)
    fallback = comm.reduce_scatter(z, 1, tp_group, native=False)
    assert native.shape == (B, T // world_size, 3)
    _check(native, fallback, "reduce_scatter native vs fallback", dims, EXACT_FP32)


def test_parallel_layers_match_torch_layers_at_tp2():
    run_ranks(2, _layers_worker)


@pytest.mark.slow
def test_parallel_layers_match_torch_layers_at_tp4():
    run_ranks(4, _layers_worker)


# ---- whole-model parity ----

def _model_worker(rank, world_size, case, sequence_parallel):
    cfg = CASES[case]
    dims = ParallelDims.from_degrees(tp=world_size)
    tokens, targets = _batch(cfg)
    ref_loss, ref_grads, ref_names = _reference_grads(cfg, tokens, targets)
    model = _build(cfg, dims, sequence_parallel)
    assert set(param_layout(model)) == ref_names, f"{dims.coords} parameter names changed"
    if cfg.tied:
        assert model.head.weight is model.embed.weight, f"{dims.coords} tied embedding came apart"
    kv_replicated = cfg.kv_heads % world_size != 0
    assert isinstance(model.layers["0"].attn.wk, ReplicatedKVLinear) == kv_replicated
    logits = model(tokens)
    assert logits.shape == (B, T, cfg.vocab_size // world_size), f"{dims.coords} logits {tuple(logits.shape)}"
    loss = vocab_parallel_cross_entropy(logits, targets, tp_group=dims.tp_group)
    loss.backward()
    sync_tp_partial_grads(model, dims)
    _check(loss.detach(), ref_loss, "loss", dims)
    _compare_grads(model, ref_grads, dims)
    _pruned_stage_check(cfg, dims, sequence_parallel)


def _prune_to_last_stage(model):
    """What a pipeline's last stage keeps: no embedding, only the last layer, the norm and the head."""
    model.embed = None
    if model.pos_embed is not None:
        model.pos_embed = None
    del model.layers["0"]
    return model


def _pruned_stage_check(cfg, dims, sequence_parallel):
    """apply_tensor_parallel works on a stage a pipeline pruned (hidden states in, logits out)."""
    torch.manual_seed(3)
    hidden = torch.randn(B, T, cfg.d_model)
    _, targets = _batch(cfg)
    ref = _prune_to_last_stage(build(cfg))
    materialize(ref, cfg, SEED, "cpu")
    ref_h = hidden.clone().requires_grad_()
    ref_loss = cross_entropy(ref(ref_h), targets)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    stage = _prune_to_last_stage(build(cfg))
    apply_tensor_parallel(stage, dims, sequence_parallel=sequence_parallel)
    materialize(stage, cfg, SEED, "cpu")
    t_rows = slice(dims.tp_rank * T // dims.tp, (dims.tp_rank + 1) * T // dims.tp)
    h = (hidden[:, t_rows] if sequence_parallel else hidden).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(stage(h), targets, tp_group=dims.tp_group)
    loss.backward()
    sync_tp_partial_grads(stage, dims)
    _check(loss.detach(), ref_loss.detach(), "pruned stage loss", dims)
    _check(h.grad, ref_h.grad[:, t_rows] if sequence_parallel else ref_h.grad, "pruned stage input grad", dims)
    _compare_grads(stage, ref_grads, dims)


def test_llama_with_split_kv_heads_matches_single_process_at_tp2():
    run_ranks(2, _model_worker, "llama_gqa", False)


@pytest.mark.slow
def test_llama_with_replicated_kv_heads_and_sequence_parallel_matches_single_process_at_tp4():
    run_ranks(4, _model_worker, "llama_gqa", True)


def test_gpt2_tied_with_sequence_parallel_matches_single_process_at_tp2():
    run_ranks(2, _model_worker, "gpt2", True)


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["nosp", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_family_matches_single_process_under_tensor_parallel(case, tp, sequence_parallel):
    run_ranks(tp, _model_worker, case, sequence_parallel)


# ---- data parallel ----

def _dp_worker(rank, world_size, case, tp, sequence_parallel):
    cfg = CASES[case]
    dims = ParallelDims.from_degrees(tp=tp)
    global_batch = 2 * dims.dp
    tokens, targets = _batch(cfg, global_batch)
    ref_loss, ref_grads, _ = _reference_grads(cfg, tokens, targets)
    model = _build(cfg, dims if tp > 1 else None, sequence_parallel)
    rows = slice(dims.dp_rank * 2, (dims.dp_rank + 1) * 2)  # contiguous slice of the global batch
    local_targets = targets[rows]
    global_count = (targets != -100).sum()
    mean = vocab_parallel_cross_entropy(model(tokens[rows]), local_targets, tp_group=dims.tp_group)
    loss = mean * (local_targets != -100).sum() / global_count  # summands of the global mean
    loss.backward()
    sync_tp_partial_grads(model, dims)
    allreduce_grads([p for _, p in model.named_parameters()], dims.dp_group, bucket_bytes=4096)  # small: several buckets
    total = comm.all_reduce_(loss.detach().clone(), dims.dp_group)
    tol = TP_FP32 if tp > 1 else EXACT_FP32
    _check(total, ref_loss, "loss summed over dp", dims, tol)
    _compare_grads(model, ref_grads, dims, tol)


def test_dp2_summed_grads_match_single_process():
    run_ranks(2, _dp_worker, "llama_gqa", 1, False)


def test_dp2_x_tp2_with_sequence_parallel_matches_single_process():
    run_ranks(4, _dp_worker, "gpt2", 2, True)


@pytest.mark.slow
def test_dp2_x_tp2_llama_matches_single_process():
    run_ranks(4, _dp_worker, "llama_gqa", 2, False)


# ---- process groups ----

def _groups_worker(rank, world_size):
    dims = ParallelDims.from_degrees(pp=world_size)
    assert dims.tp_group is None and dims.dp_group is None, f"{dims.coords} degree-1 groups must be None"
    assert comm.group_size(dims.pp_group) == world_size and comm.group_rank(dims.pp_group) == dims.pp_rank
    in_embed = dims.pp_rank in (0, world_size - 1)
    assert (dims.embed_group is not None) == in_embed, f"{dims.coords} embed group membership"
    total = comm.all_reduce_(torch.tensor([float(rank)]), dims.pp_group)
    assert total.item() == sum(range(world_size)), f"{dims.coords} pp all-reduce gave {total.item()}"
    if in_embed:
        pair = comm.all_reduce_(torch.tensor([float(rank)]), dims.embed_group)
        assert pair.item() == float(0 + world_size - 1), f"{dims.coords} embed all-reduce gave {pair.item()}"


def test_every_rank_builds_its_groups_and_middle_stages_have_no_embed_group():
    run_ranks(3, _groups_worker)


# ---- no processes ----

def test_grad_buckets_keep_parameter_order_and_respect_the_byte_cap():
    params = [torch.zeros(n, requires_grad=True) for n in (10, 20, 300, 5, 5)]
    for p in params:
        p.grad = torch.ones_like(p)
    buckets = grad_buckets(params, bucket_bytes=40 * 4)
    assert [[p.numel() for p in b] for b in buckets] == [[10, 20], [300], [5, 5]]


def test_tensor_parallel_rejects_a_model_it_cannot_split():
    cfg = ModelConfig(vocab_size=66, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=64)
    with pytest.raises(AssertionError, match=r"parallel.tp: must divide model.vocab_size=66 .* got 4; pad"):
        apply_tensor_parallel(build(cfg), ParallelDims(tp=4))
