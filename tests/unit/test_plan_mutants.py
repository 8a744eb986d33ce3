"""The planner (plan/cost.py, devices.py, auto.py, calibrate.py, loss.py) against figures derived by hand.

A device profile with zero latencies and zero operator overhead and round rates makes every term of the
model a closed form of the recipe: a microbatch's forward is tokens x its stage's forward FLOPs per token /
(tp x peak) (flops_per_token / 3 for the whole model: L blocks and the 2 D V head), its backward twice that,
a ring moves (n-1)/n of its bytes per step, a 1f1b pipeline of p stages and m equal microbatches takes
(m + p - 1)(F + B). Mutants these tests kill (each survived the unit tests of plan/, which also kill P13,
the gradient group without cp, by test_plan_search's zero-3 case):

  P01  the B / F ratio 2 under full recompute (the simulated makespan of split-backward and V schedules off)
  P04  the all-to-all bytes without the (ep-1)/ep that stays on the rank
  P05  pp fill / drain transfers counted once, not twice per boundary ((pp-1) x hop instead of 2 (pp-1) x hop)
  P06  per-block FLOPs that keep the head (flops_per_token / 3 / L), so the head is counted L+1 times
  P07  the head not charged to the last pp stage
  P08  the least busy pp rank taken for the busiest
  P09  compute not divided by tp
  P11  a backward of one forward instead of two
  P12  the bubble that keeps the p2p transfers
  P10  selective recompute charged twice the attention core
  P13  (also) the gradient group without cp (dp x cp under context parallelism)
  P14  the dp all-reduce not overlapped with the last backward on devices
  P15  ZeRO 1/2's parameter all-gather after the step dropped
  P16  the optimizer step not slowed by ranks sharing a CPU node's cores
  P18  a pp boundary under sequence parallelism sent whole, not T/tp
  P19  one tp all-reduce per block forward, not two
  P20  tokens/s from the pipeline alone (the dp exposure and the optimizer left out)
  D01  the H100's sparse bf16 peak (1979 TFLOP/s) in place of the dense 989
  D03  the "cpu" placeholder profile not counted as gloo's staged collectives (auto vs pre-flight)
  A03  the ranks agreeing on the largest memory of any rank, not the smallest
  A04  a CPU launch giving every rank the node's whole memory, not its share
  K01  calibrate's matmul FLOPs counted as n^3, not 2 n^3
  K02  a block's per-token time over the 4 T tokens of the larger batch, not the 3 T it adds
  K04  the two-point fit's latency without the transfer time of the small message
  L01  the fused loss's kept head-weight gradient counted whole, not V/tp rows
  L02  the fused loss's sequence-parallel gather of the hidden states (N x D) dropped
  L03  the fused loss's fp32 chunk copy on the CPU in bf16 dropped
  L04  the unfused loss backward holding 2 N x V/tp fp32 tensors, not 3
  L05  (also; test_plan_memory_gpu's fp8 case kills it) the Triton cross-entropy's logit gradient counted in fp32
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipetrain.config import ModelConfig, ParallelConfig, Recipe, TrainConfig
from pipetrain.models import flops_per_token
from pipetrain.plan.auto import cuda_profile
from pipetrain.plan.cost import step_time
from pipetrain.plan.devices import DEVICES, DeviceProfile

MODEL = ModelConfig(family="llama", vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=128,
                    max_seq_len=64)
T, GB = 32, 8
PEAK, BW = 1e12, 1e9
# no latency, no dispatch overhead, efficiency 1: every term a closed form
PROFILE = DeviceProfile("test", 1e15, PEAK, PEAK, BW, 0.0, BW, 0.0, efficiency=1.0, op_overhead=0.0, cores=0,
                        mem_bw=1e12)
HEAD = 2 * MODEL.d_model * MODEL.vocab_size            # forward FLOPs per token of the LM head
BLOCK = (flops_per_token(MODEL, T) / 3 - HEAD) / MODEL.n_layers  # of one block (attention at T included)


def _recipe(**parallel) -> Recipe:
    return Recipe(model=MODEL, train=TrainConfig(global_batch=GB, seq_len=T), parallel=ParallelConfig(**parallel))


def test_one_rank_step_is_three_forwards_of_the_whole_model_per_token():
    """pp 1, tp 1, dp 1, one microbatch: compute = tokens x flops_per_token / peak; no comm, no bubble;
    tokens/s = the step's tokens over compute + the optimizer's time."""
    t = step_time(_recipe(), 1, PROFILE, states=(0, 0, 0))
    assert t.compute == pytest.approx(GB * T * flops_per_token(MODEL, T) / PEAK, rel=1e-9)
    assert t.bubble == 0 and t.tp_comm == 0 and t.dp_comm == 0 and t.pp_comm == 0
    assert t.total == pytest.approx(t.compute, rel=1e-9)
    assert t.tokens_per_s == pytest.approx(GB * T / t.compute, rel=1e-9)


def test_tp_divides_the_matmuls_and_adds_four_all_reduces_per_block():
    """tp 2: each rank does half the FLOPs; per block and microbatch 2 all-reduces of the (B, T, D) fp32
    activation forward and 2 backward, each a 2-rank ring moving 2 x 1/2 of the bytes."""
    t = step_time(_recipe(tp=2), 2, PROFILE, states=(0, 0, 0))
    assert t.compute == pytest.approx(GB * T * flops_per_token(MODEL, T) / 2 / PEAK, rel=1e-9)
    act = GB * T * MODEL.d_model * 4
    assert t.tp_comm == pytest.approx(MODEL.n_layers * 4 * act / BW, rel=1e-9)
    assert t.total == pytest.approx(t.compute + t.tp_comm, rel=1e-9)


def test_a_1f1b_pipeline_is_m_plus_p_minus_1_slots_of_the_busiest_stage_plus_its_transfers():
    """pp 2, 4 microbatches of 2 sequences: the last stage holds 2 blocks and the head (the busiest);
    F = tokens x (2 blocks + head) / peak, B = 2 F; the 1f1b makespan is (m + p - 1)(F + B), the bubble
    (p - 1)(F + B); the boundary activation crosses 2 (p - 1) times on the fill and drain path."""
    m, pp = 4, 2
    t = step_time(_recipe(pp=pp, microbatches=m, schedule="1f1b"), pp, PROFILE, states=(0, 0, 0))
    tokens = GB // m * T
    f = tokens * (2 * BLOCK + HEAD) / PEAK
    assert t.compute == pytest.approx(m * 3 * f, rel=1e-9)
    assert t.bubble == pytest.approx((pp - 1) * 3 * f, rel=1e-6)
    hop = tokens * MODEL.d_model * 4 / BW
    assert t.pp_comm == pytest.approx(2 * (pp - 1) * hop, rel=1e-9)
    assert t.total == pytest.approx((m + pp - 1) * 3 * f + t.pp_comm, rel=1e-6)


def test_the_dp_all_reduce_hides_behind_the_last_backward_and_zero_adds_the_gather_after_the_step():
    """dp 2 on devices: the gradient all-reduce (2 x 1/2 of the bytes) overlaps the last microbatch's backward
    (2 F), the rest is exposed; ZeRO 1 all-reduces and ZeRO 2 reduce-scatters (1/2), and both all-gather the
    parameters after the step (1/2), exposed."""
    grads = 64e6  # bytes: large enough that the all-reduce outlasts the backward
    f = GB // 2 * T * flops_per_token(MODEL, T) / 3 / PEAK
    plain = step_time(_recipe(), 2, PROFILE, states=(grads, grads, 0))
    assert plain.dp_comm == pytest.approx(grads / BW, rel=1e-9)
    assert plain.dp_exposed == pytest.approx(grads / BW - 2 * f, rel=1e-9)
    zero1 = step_time(_recipe(zero=1), 2, PROFILE, states=(grads, grads, 0))
    assert zero1.dp_comm == pytest.approx(grads / BW + grads / 2 / BW, rel=1e-9)  # all-reduce + all-gather
    assert zero1.dp_exposed == pytest.approx(grads / BW - 2 * f + grads / 2 / BW, rel=1e-9)
    zero2 = step_time(_recipe(zero=2), 2, PROFILE, states=(grads, grads, 0))
    assert zero2.dp_comm == pytest.approx(grads / BW, rel=1e-9)  # reduce-scatter + all-gather, 1/2 each
    assert zero2.dp_exposed == pytest.approx(grads / 2 / BW - 2 * f + grads / 2 / BW, rel=1e-9)
    for t in (plain, zero1, zero2):
        assert t.tokens_per_s == pytest.approx(GB * T / t.total, rel=1e-9)
        assert t.total == pytest.approx(t.compute + t.dp_exposed, rel=1e-9)


def test_under_cp_the_gradients_are_reduced_over_the_cp_ranks_too():
    """cp 2 on 2 ranks: dp is 1 but each cp rank holds the gradient of its own tokens, so the all-reduce runs
    over dp x cp = 2 ranks."""
    grads = 8e6
    t = step_time(_recipe(cp=2), 2, PROFILE, states=(grads, grads, 0))
    assert t.dp_comm == pytest.approx(grads / BW, rel=1e-9)


@pytest.mark.parametrize("name, peak", [("h100-sxm-80gb", 989e12), ("h100-pcie-80gb", 756e12),
                                        ("h200-141gb", 989e12), ("a100-80gb", 312e12), ("l40s", 362.05e12)])
def test_device_table_holds_the_datasheets_dense_bf16_peaks(name, peak):
    """NVIDIA datasheets, dense (the sparse figures are twice these)."""
    assert DEVICES[name].bf16_flops == peak


@pytest.mark.parametrize("card, entry", [("NVIDIA H100 PCIe", "h100-pcie-80gb"),
                                         ("NVIDIA H100 80GB HBM3", "h100-sxm-80gb"),
                                         ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
                                         ("NVIDIA A100-SXM4-80GB", "a100-80gb")])
def test_a_card_name_that_holds_a_shorter_key_gets_its_own_profile(card, entry):
    got = cuda_profile(card, 200e9)
    assert dataclasses.replace(got, memory_bytes=0) == dataclasses.replace(DEVICES[entry], memory_bytes=0)


SMALL_HEAD = dataclasses.replace(MODEL, vocab_size=8)  # the head < 1% of a stage: B / F is 3 under full recompute


@pytest.mark.parametrize("schedule, v, split", [("1f1b", 1, True), ("interleaved-1f1b", 2, True), ("zbv", 2, False),
                                                ("dualpipev", 2, False)])
def test_a_pipeline_under_full_recompute_takes_the_simulated_makespan_at_its_own_backward_cost(schedule, v, split):
    """Full recompute reruns a block's forward inside its backward: B = 3 F (2 F + the recomputed blocks; the head
    is not recomputed, under 1% here). Schedules whose order depends on B / F (a split backward's W, the V
    schedules) must be timed at that ratio: the step's pipeline time is the simulator's makespan at these F and B
    (pipetrain.parallel.pipeline.schedules.simulate), within the head's share."""
    from pipetrain.parallel.pipeline.schedules import build_all_schedules, placement_of, simulate
    from pipetrain.parallel.pipeline.stage import stage_costs
    m, pp = 4, 2
    recipe = Recipe(model=SMALL_HEAD, train=TrainConfig(global_batch=GB, seq_len=T),
                    parallel=ParallelConfig(pp=pp, microbatches=m, schedule=schedule, virtual_stages=v,
                                            split_backward=split, recompute="full"))
    t = step_time(recipe, pp, PROFILE, states=(0, 0, 0))
    head = 2 * SMALL_HEAD.d_model * SMALL_HEAD.vocab_size
    block = (flops_per_token(SMALL_HEAD, T) / 3 - head) / SMALL_HEAD.n_layers
    tokens, layers = GB // m * T, SMALL_HEAD.n_layers // pp
    f = tokens * (layers * block + head) / PEAK
    b = 2 * f + tokens * layers * block / PEAK
    costs = stage_costs(SMALL_HEAD, recipe.parallel, T) if schedule == "zbv" else None  # as the run builds it
    actions = build_all_schedules(schedule, pp, m, v, backward_cost=3.0, split_backward=split, stage_costs=costs)
    makespan = simulate(actions, cost_f=f, cost_b=b, virtual_stages=v, placement=placement_of(schedule)).makespan
    assert t.total - t.pp_comm == pytest.approx(makespan, rel=1e-3)


def test_the_expert_all_to_alls_send_the_routed_copies_that_leave_the_rank():
    """ep 2 over dp 2: per MoE block and microbatch, a dispatch and a combine all-to-all forward and both again
    backward, each sending k copies of every token's D-wide fp32 row, (ep-1)/ep of them to the other rank."""
    moe = ModelConfig(family="qwen3_moe", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      max_seq_len=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
    recipe = Recipe(model=moe, train=TrainConfig(global_batch=GB, seq_len=T), parallel=ParallelConfig(ep=2, dp=2))
    t = step_time(recipe, 2, PROFILE, states=(0, 0, 0))
    tokens = GB // 2 * T
    sent = tokens * moe.num_experts_per_tok * moe.d_model * 4 * (2 - 1) / 2
    assert t.ep_comm == pytest.approx(moe.n_layers * 4 * sent / BW, rel=1e-9)


def test_recompute_adds_the_forward_it_reruns():
    """Selective recompute reruns the attention core (scores and values: 4 Hq K T/2 FLOPs per token per block),
    full recompute every block's forward (not the head)."""
    none = step_time(_recipe(), 1, PROFILE, states=(0, 0, 0)).compute
    selective = step_time(_recipe(recompute="selective"), 1, PROFILE, states=(0, 0, 0)).compute
    full = step_time(_recipe(recompute="full"), 1, PROFILE, states=(0, 0, 0)).compute
    m = MODEL
    assert selective - none == pytest.approx(GB * T * m.n_layers * 4 * m.n_heads * m.head_dim * T / 2 / PEAK, rel=1e-9)
    assert full - none == pytest.approx(GB * T * m.n_layers * BLOCK / PEAK, rel=1e-9)


def test_the_optimizer_step_streams_40_bytes_per_updated_parameter_and_shares_the_node_s_cores():
    """AdamW: the gradient-norm read (4), parameter, gradient and two moments read (16) and three written (12),
    foreach temporaries (8); states[2] is the two fp32 moments (8 bytes per parameter). On a CPU node of 1 core
    running 2 ranks, each rank's step runs at half the core's bandwidth."""
    moments = 8e6
    on_device = step_time(_recipe(), 1, PROFILE, states=(0, 0, moments))
    assert on_device.optimizer == pytest.approx(moments / 8 * 40 / PROFILE.mem_bw, rel=1e-9)
    cpu = dataclasses.replace(PROFILE, cores=1)
    shared = step_time(_recipe(), 2, cpu, ranks_per_node=2, states=(0, 0, moments))
    assert shared.optimizer == pytest.approx(2 * moments / 8 * 40 / PROFILE.mem_bw, rel=1e-9)


def test_sequence_parallel_sends_a_tp_rank_s_slice_of_the_boundary_activation():
    """pp 2 x tp 2 with sequence parallelism: a stage boundary's (B, T/tp, D) fp32 slice crosses per hop."""
    t = step_time(_recipe(pp=2, tp=2, sequence_parallel=True), 4, PROFILE, states=(0, 0, 0))
    assert t.pp_comm == pytest.approx(2 * (2 - 1) * GB * T / 2 * MODEL.d_model * 4 / BW, rel=1e-9)


def test_parallel_auto_on_a_cpu_launch_predicts_the_memory_the_preflight_check_holds_it_to(monkeypatch):
    """A CPU launch plans from the "cpu" placeholder profile (plan.auto.launch_profile) and its pre-flight check
    counts gloo's staged collective outputs and the torch references (preflight.memory_estimate): the two must
    be the same estimate, or auto picks a layout the check then refuses."""
    from pipetrain.plan.search import KEYS, evaluate
    from pipetrain.preflight import memory_estimate
    monkeypatch.delenv("PIPETRAIN_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    recipe = _recipe(zero=1)  # dp 2: ZeRO's all-gather, which gloo stages through a flat copy
    cpu = dataclasses.replace(DEVICES["cpu"], memory_bytes=1e15)
    plan = evaluate(recipe, {k: getattr(recipe.parallel, k) for k in KEYS}, 2, cpu)
    assert [r.total for r in plan.workers] == [r.total for r in memory_estimate(recipe, 2) if r.role == "worker"]


def test_every_rank_plans_from_rank_0_s_profile_with_the_smallest_memory_of_any_rank(monkeypatch):
    """agree_profile: the plan must fit the smallest rank (a node with less RAM per rank, a smaller card)."""
    from pipetrain.plan import auto
    mine = DEVICES["a100-80gb"]
    others = [mine.as_dict(), {**mine.as_dict(), "memory_bytes": 40e9}, {**mine.as_dict(), "memory_bytes": 90e9}]
    monkeypatch.setattr(auto, "all_gather_object", lambda obj, n: others)
    agreed = auto.agree_profile(mine, 3)
    assert agreed.memory_bytes == 40e9
    assert dataclasses.replace(agreed, memory_bytes=mine.memory_bytes, source=mine.source) == mine


def test_a_cpu_launch_shares_the_node_s_memory_among_its_ranks(monkeypatch):
    import os
    from pipetrain.plan import auto
    monkeypatch.delenv("PIPETRAIN_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert auto.launch_profile(8, ranks_per_node=4).memory_bytes == pytest.approx(physical / 4)
    assert auto.launch_profile(2).memory_bytes == pytest.approx(physical / 2)


def test_the_two_point_fit_recovers_a_link_s_bandwidth_and_latency():
    """time(bytes) = latency + bytes / bandwidth, timed at SMALL and LARGE bytes: the fit gives both back."""
    from pipetrain.plan.calibrate import LARGE, SMALL, _fit
    lat, bw = 3e-4, 2e9
    got_bw, got_lat = _fit(lat + SMALL / bw, lat + LARGE / bw)
    assert got_bw == pytest.approx(bw, rel=1e-9) and got_lat == pytest.approx(lat, rel=1e-6)


def test_the_timing_helpers_turn_seconds_into_rates(monkeypatch):
    """With the clock scripted: an n^3 matmul is 2 n^3 FLOPs; a block's per-token time is the difference between
    4 sequences and 1 over the 3 T tokens it adds, and its fixed cost what 1 sequence leaves."""
    from pipetrain.plan import calibrate as calibrate_mod
    monkeypatch.setattr(calibrate_mod, "_median_time", lambda fn, repeats: 0.5)
    assert calibrate_mod.matmul_flops(torch.float32, n=8, repeats=1) == 2 * 8 ** 3 / 0.5
    times = iter([2.0, 5.0])  # 1 sequence of T, then 4
    monkeypatch.setattr(calibrate_mod, "_median_time", lambda fn, repeats: next(times))
    per_token, fixed = calibrate_mod.block_timing(MODEL, T, repeats=1)
    assert per_token == pytest.approx(3.0 / (3 * T)) and fixed == pytest.approx(2.0 - T * 3.0 / (3 * T))


LOSS_MODEL = dataclasses.replace(MODEL, vocab_size=4096)


def _loss_recipe(precision="fp32", **parallel) -> Recipe:
    return Recipe(model=LOSS_MODEL, train=TrainConfig(global_batch=GB, seq_len=T, precision=precision),
                  parallel=ParallelConfig(**parallel))


def test_the_loss_terms_count_this_tp_rank_s_vocabulary_shard():
    """plan/loss.py by hand, V 4096, D 64, tp 2 (2048 vocabulary rows a rank), N tokens of one microbatch:
    the fused loss keeps the head weight's gradient (V/tp x D, in the GEMMs' dtype); the unfused torch path's
    backward holds the logits, the log-softmax output's gradient and the logits' (3 x N x V/tp fp32); the Triton
    path one gradient in the logits' dtype."""
    from pipetrain.plan.loss import fused_loss_weight_grad, loss_backward_bytes
    V, D, N = 4096, 64, 256
    assert fused_loss_weight_grad(_loss_recipe(tp=2)) == 4 * V // 2 * D
    assert fused_loss_weight_grad(_loss_recipe("bf16", tp=2)) == 2 * V // 2 * D
    assert loss_backward_bytes(_loss_recipe(tp=2), N) == 3 * 4 * N * V // 2
    assert loss_backward_bytes(_loss_recipe("bf16", tp=2), N, kernels=True) == 2 * N * V // 2


def test_the_fused_loss_temporaries_are_one_chunk_s_and_what_bf16_and_sequence_parallelism_add():
    """fused_loss_bytes: the (C, V/tp) chunk buffer, C = chunk_rows capped at the tokens; in bf16 autocast's bf16
    copy of the head weight and on the CPU the chunk's fp32 copy for the softmax; under sequence parallelism the
    hidden states gathered along T (N x D)."""
    from pipetrain.kernels.linear_cross_entropy import chunk_rows
    from pipetrain.plan.loss import fused_loss_bytes
    V, D = 4096 // 2, 64
    for n in (16, 256, 4096):  # fewer tokens than a chunk, and more
        c = min(n, chunk_rows(n, D, V, "cpu"))
        assert fused_loss_bytes(_loss_recipe(tp=2), n, "cpu") == 4 * c * V
        assert fused_loss_bytes(_loss_recipe("bf16", tp=2), n, "cpu") == 2 * c * V + 2 * V * D + 4 * c * V
        c_gpu = min(n, chunk_rows(n, D, V, "cuda"))
        assert fused_loss_bytes(_loss_recipe("bf16", tp=2), n, "cuda") == 2 * c_gpu * V + 2 * V * D
        assert fused_loss_bytes(_loss_recipe(tp=2, sequence_parallel=True), n, "cpu") == 4 * c * V + 4 * n * D
    assert chunk_rows(16, D, V, "cpu") == 16  # at most the tokens: a 16-token microbatch's buffer is 16 rows
