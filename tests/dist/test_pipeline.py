"""Pipeline parallelism on gloo CPU processes: every schedule reproduces single-process gradient
accumulation over the same microbatches, in loss and in every gradient (fp32 round-off only)."""
import dataclasses

import pytest
import torch
import torch.distributed as dist

from pipetrain.config import ModelConfig, ParallelConfig
from pipetrain.data import Batch
from pipetrain.models import build, materialize, param_layout
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.pipeline.executor import Executor
from pipetrain.parallel.data.grads import clip_grad_norm, sync_grads
from pipetrain.parallel.pipeline.stage import build_stage, layer_costs, partition_layers, stage_layout
from pipetrain.parallel.pipeline.schedules import build_all_schedules, build_schedule
from pipetrain.parallel.pipeline.schedules.builders import zbv_orders
from pipetrain.parallel.pipeline.schedules.placement import place
from pipetrain.parallel.tensor.layers import apply_tensor_parallel
from pipetrain.parallel.pipeline.weight_grads import apply_grad_accumulation_fusion
from pipetrain.trainer import loss_sum
from tests.harness import EXACT_FP32, TP_FP32, run_ranks

SEED, MB, T = 99, 2, 16
LLAMA = ModelConfig(family="llama", vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2,
                    ffn_hidden=64, max_seq_len=32)
GPT2 = ModelConfig(family="gpt2", vocab_size=64, d_model=32, n_layers=4, n_heads=4, max_seq_len=32)  # tied


def _microbatches(cfg, num):
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (num * MB, T + 1), generator=gen)
    targets = tokens[:, 1:].clone()
    targets[0, :5] = -100  # masked targets must not tilt the mean
    return Batch(tokens[:, :-1], targets).split(num), int((targets != -100).sum())


def _reference(cfg, num):
    """Single process: gradient accumulation over the same microbatches, loss / global token count."""
    model = materialize(build(cfg), cfg, SEED, "cpu")
    mbs, count = _microbatches(cfg, num)
    total = 0.0
    for mb in mbs:
        loss = loss_sum(model(mb.inputs), mb.targets)
        (loss / count).backward()
        total += float(loss)
    norm = clip_grad_norm(model, ParallelDims(), 0.0)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return total / count, grads, norm


def _pipeline_worker(rank, world_size, cfg, pp, tp, schedule, virtual_stages, num, split_backward=False,
                     batched=False, stage_costs=None, zbv_order=None):
    dims = ParallelDims.from_degrees(tp=tp, pp=pp)
    pcfg = ParallelConfig(pp=pp, tp=tp, schedule=schedule, virtual_stages=virtual_stages, microbatches=num)
    model = build(cfg)
    apply_tensor_parallel(model, dims)
    model, chunks, specs = build_stage(model, dims, pcfg, T)
    materialize(model, cfg, SEED, "cpu")
    apply_grad_accumulation_fusion(model, 0)  # the tiny model's weights are all below the default threshold
    tp_group = dims.tp_group if tp > 1 else None
    # batched: NCCL's path (one batch_isend_irecv per run), here on gloo; else gloo's default, one by one
    executor = Executor(chunks, specs, dims, (MB, T, cfg.d_model), torch.float32,
                        loss_fn=lambda logits, targets: loss_sum(logits, targets, tp_group), batch_p2p=batched)
    actions = build_schedule(schedule, dims.pp_rank, pp, num, virtual_stages, split_backward=split_backward,
                             stage_costs=stage_costs)
    if zbv_order is not None:  # one of zbv's candidate orders, forced instead of the one a run picks
        actions = place(zbv_orders(pp, num, stage_costs)[zbv_order], 2, 2.0, True, "v")[dims.pp_rank]
    # split: every rank but the first splits its backward (rank 0's W may all follow their B directly, and
    # then B does the whole backward: schedules._merge_first_stage_weight_grads)
    assert any(a.kind == "W" for a in actions) == split_backward or (split_backward and dims.pp_rank == 0)
    mbs, count = _microbatches(cfg, num)
    local = executor.run(actions, mbs, count)
    sync_grads(model, dims)
    norm = clip_grad_norm(model, dims, 0.0)
    dist.all_reduce(local)  # only the last stage holds a loss; tp ranks hold copies
    loss = float(local) / count / tp

    ref_loss, ref_grads, ref_norm = _reference(cfg, num)
    tol = TP_FP32 if tp > 1 else EXACT_FP32
    torch.testing.assert_close(loss, ref_loss, **tol, msg=lambda m: f"{dims.coords} loss: {m}")
    torch.testing.assert_close(norm, ref_norm, **tol, msg=lambda m: f"{dims.coords} grad norm: {m}")
    params = dict(model.named_parameters())
    for name, (shape, slices) in param_layout(model).items():
        ref_name = "embed.weight" if name == "head.weight" and cfg.tied else name
        torch.testing.assert_close(params[name].grad, ref_grads[ref_name][slices], **tol,
                                   msg=lambda m: f"{dims.coords} grad of {name}: {m}")
    # the stage holds only its own layers, under their global names
    held = {int(n.split(".")[1]) for n in params if n.startswith("layers.")}
    assert held == {i for s in specs for i in s.layers}, f"{dims.coords} holds layers {held}"


@pytest.mark.parametrize("split", [True, False], ids=["split", "whole-backward"])
@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
def test_pp2_schedules_match_single_process_grads_with_tied_embeddings(schedule, v, split):
    run_ranks(2, _pipeline_worker, GPT2, 2, 1, schedule, v, 4, split)


@pytest.mark.slow
def test_pp4_1f1b_split_backward_matches_single_process_grads():
    run_ranks(4, _pipeline_worker, LLAMA, 4, 1, "1f1b", 1, 4, True)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_batched_p2p_path_matches_single_process_grads(schedule, v):
    # The path NCCL takes (each run of comm actions in one batch_isend_irecv, receives waited at the
    # consuming compute), exercised on gloo, with the split backward's W actions in between.
    run_ranks(2, _pipeline_worker, GPT2, 2, 1, schedule, v, 4, True, True)


LLAMA8 = dataclasses.replace(LLAMA, n_layers=8)  # pp 4 in a V: 8 stages


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
@pytest.mark.parametrize("pp,cfg,num", [pytest.param(2, GPT2, 4, id="pp2-gpt2-tied"),
                                        pytest.param(4, LLAMA8, 8, id="pp4-llama", marks=pytest.mark.slow)])
def test_v_schedules_match_single_process_grads(schedule, pp, cfg, num):
    # two chunks per rank in a V: rank 0 holds the embedding and the (tied) head, rank pp-1's two chunks
    # hand over locally; the split backward's W actions fill the waits
    run_ranks(pp, _pipeline_worker, cfg, pp, 1, schedule, 2, num, True)


@pytest.mark.parametrize("order", ["equal", "costed", "fixed"])
def test_every_zbv_candidate_order_matches_single_process_grads(order):
    # zbv's candidate orders for a head-heavy last stage (as pipeline.stage_costs gives the benchmark's
    # llama): list-scheduled for equal costs, list-scheduled on the costs, the paper's fixed order. Each is
    # a different order of the same computes, and each gives the single-process gradients.
    costs = [1.0, 3.0, 3.0, 3.7]
    orders = zbv_orders(2, 8, costs)
    assert len({str(o) for o in orders.values()}) == 3
    assert build_all_schedules("zbv", 2, 8, 2, stage_costs=costs) == place(orders["fixed"], 2, 2.0, True, "v")
    run_ranks(2, _pipeline_worker, GPT2, 2, 1, "zbv", 2, 8, True, False, costs, order)


LLAMA6 = dataclasses.replace(LLAMA, n_layers=6)  # one layer per chunk at pp 2 x v 3 and pp 3 x v 2
GPT2_6 = dataclasses.replace(GPT2, n_layers=6)


@pytest.mark.parametrize("cfg,pp,schedule,v,num", [
    pytest.param(LLAMA6, 2, "interleaved-1f1b", 3, 4, id="interleaved-pp2-v3"),
    pytest.param(GPT2_6, 3, "interleaved-1f1b", 2, 6, id="interleaved-pp3-v2-tied"),
    pytest.param(LLAMA6, 3, "zbv", 2, 6, id="zbv-pp3"),
    pytest.param(GPT2_6, 3, "dualpipev", 2, 6, id="dualpipev-pp3-tied"),
    pytest.param(LLAMA6, 2, "interleaved-1f1b", 3, 8, id="interleaved-pp2-v3-two-groups"),
])
def test_chunked_schedules_past_two_ranks_and_two_chunks_match_single_process_grads(cfg, pp, schedule, v, num):
    # Every other chunked case in the default run has pp = v = 2, where rank pp-1 is also rank 1 and
    # each rank talks to one neighbour: an odd pp, a third chunk, or a middle rank (which sends and
    # receives in both directions) is what shows a stage wired to the wrong neighbour or chunk, or a
    # tied embedding summed between the first stage and the second rank instead of the last.
    run_ranks(pp, _pipeline_worker, cfg, pp, 1, schedule, v, num, True, timeout_s=30)


def test_v_schedule_batched_p2p_with_tp2_matches_single_process_grads():
    run_ranks(4, _pipeline_worker, GPT2, 2, 2, "zbv", 2, 4, True, True)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("pp,schedule,v,num", [(4, "gpipe", 1, 6), (4, "1f1b", 1, 3), (2, "1f1b", 1, 7),
                                               (2, "interleaved-1f1b", 2, 6), (4, "interleaved-1f1b", 1, 8)])
@pytest.mark.parametrize("split", [False, True], ids=["whole-backward", "split"])
def test_pipeline_matrix_matches_single_process_grads(cfg, pp, schedule, v, num, split):
    run_ranks(pp, _pipeline_worker, cfg, pp, 1, schedule, v, num, split)


@pytest.mark.parametrize("cfg", [GPT2, dataclasses.replace(LLAMA, n_kv_heads=1)], ids=["gpt2", "llama-replicated-kv"])
def test_pp2_with_tp2_split_backward_matches_single_process_grads(cfg):
    # tp's column / row linears defer their weight gradients; one kv head at tp 2 is replicated, and
    # its per-rank slice of wk / wv gets its gradient in B instead
    run_ranks(4, _pipeline_worker, cfg, 2, 2, "1f1b", 1, 2, True)


# ---- partitioning and recipe validation: no processes ----

def test_partition_balances_head_cost_and_respects_explicit_layers():
    big_vocab = ModelConfig(family="llama", vocab_size=32000, d_model=64, n_layers=8, n_heads=4)
    counts = partition_layers(big_vocab, 2, 128)
    assert sum(counts) == 8 and counts[0] > counts[1]  # the last stage carries the expensive head
    assert partition_layers(LLAMA, 4, T) == [1, 1, 1, 1]
    explicit = stage_layout(LLAMA, ParallelConfig(pp=2, stage_layers=[3, 1]), T)
    assert explicit == [[0, 1, 2], [3]]


def test_interleaved_partition_balances_ranks_without_growing_the_busiest_stage():
    cfg = ModelConfig(family="llama", vocab_size=8192, d_model=256, n_layers=8, n_heads=8, n_kv_heads=4,
                      ffn_hidden=704)  # benchmarks/pipeline.py's model: the head costs 2.7 blocks
    block, embed, head = layer_costs(cfg, 128)
    for pp, stages in ((2, 4), (3, 6), (2, 6)):
        flat, interleaved = partition_layers(cfg, stages, 128), partition_layers(cfg, stages, 128, pp)

        def loads(counts):
            cost = [n * block + (embed if s == 0 else 0) + (head if s == stages - 1 else 0) for s, n in enumerate(counts)]
            return [sum(cost[r::pp]) for r in range(pp)], max(cost)
        (flat_ranks, flat_stage), (ranks, stage) = loads(flat), loads(interleaved)
        assert sum(interleaved) == 8 and min(interleaved) >= 1
        assert max(ranks) < max(flat_ranks) and stage <= flat_stage, (pp, stages, flat, interleaved)
    assert partition_layers(cfg, 4, 128, 2) == [2, 2, 3, 1]  # ranks 6.0 / 5.7 blocks instead of 5.0 / 6.7
    assert partition_layers(cfg, 2, 128, 2) == partition_layers(cfg, 2, 128)  # one stage per rank: unchanged


def test_v_partition_balances_both_chunks_of_each_rank_head_and_embedding_on_rank_0():
    cfg = ModelConfig(family="llama", vocab_size=8192, d_model=256, n_layers=8, n_heads=8, n_kv_heads=4,
                      ffn_hidden=704)  # the head costs 2.7 blocks and sits with the embedding on rank 0
    block, embed, head = layer_costs(cfg, 128)
    for pp in (2, 3, 4):
        stages = 2 * pp
        counts = partition_layers(cfg, stages, 128, pp, "v")
        cost = [n * block + (embed if s == 0 else 0) + (head if s == stages - 1 else 0) for s, n in enumerate(counts)]
        v_loads = [cost[r] + cost[stages - 1 - r] for r in range(pp)]
        flat = partition_layers(cfg, stages, 128)
        flat_cost = [n * block + (embed if s == 0 else 0) + (head if s == stages - 1 else 0) for s, n in enumerate(flat)]
        assert sum(counts) == 8 and min(counts) >= 1 and max(cost) <= max(flat_cost)
        assert max(v_loads) <= max(flat_cost[r] + flat_cost[stages - 1 - r] for r in range(pp)), (pp, counts)
    assert partition_layers(cfg, 4, 128, 2, "v") == [1, 3, 3, 1]  # ranks 5.7 / 6 blocks, not [2, 3, 2, 1]'s 6.7 / 5
    layout = stage_layout(cfg, ParallelConfig(pp=2, virtual_stages=2, schedule="zbv", microbatches=4), 128)
    assert [len(s) for s in layout] == partition_layers(cfg, 4, 128, 2, "v")
