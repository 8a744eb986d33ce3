"""Predicted step time of one layout on a device profile: compute, tp / dp / pp communication, bubble.

    compute     matmul FLOPs (models.flops_per_token, the busiest pp rank's share by pipeline.layer_costs,
                plus one more block forward under full recompute) / (tp x peak x efficiency)
    tp comm     per block, 2 all-reduces of the (B, T, D) activation forward and 2 backward (sequence
                parallel: reduce-scatter + all-gather, the same bytes); exposed: they sit between matmuls
    cp comm     per block, the all-gather of K and V over cp forward (parallel/context/attention.py) and the
                reduce-scatter of their gradients backward: each (cp-1)/cp x 2 x B x T x Hkv/tp x K x dtype
                bytes; exposed (the attention waits for them); recompute gathers again in the backward
    ep comm     parallel.ep: per MoE block, the dispatch and combine all-to-alls of the micro-batch's k routed
                copies of each token ((ep-1)/ep of them leave the rank), forward and again backward
    pipeline    the schedule's action lists simulated (schedules.simulate) at these F / B costs, plus
                2 (pp - 1) activation transfers on the fill and drain path; bubble = idle fraction
    dp comm     gradient all-reduce (ZeRO 2/3: reduce-scatter) of this rank's gradients, overlapped with the
                last microbatch's backward (parallel/data/zero.py, data/allreduce.py launch buckets then), the rest
                exposed; ZeRO 1/2 add the parameter all-gather after the step, exposed; ZeRO 3 has none after
                the step but gathers every unit's parameters in each microbatch's forward and again in its
                backward (but the embedding's; once per step with reshard_after_forward false; the linear
                weights in bf16 under train.precision bf16), prefetched one unit ahead, so
                on devices they hide behind compute up to its length (on a CPU profile they are exposed).
                Under cp the group is dp x cp (every cp rank holds the gradient of its own tokens)
    optimizer   the gradient norm and the AdamW update of the parameters this rank updates (its ZeRO shard),
                memory-bound: OPTIMIZER_BYTES per parameter / the profile's memory bandwidth
A ring collective over n ranks moves 2 (n-1)/n x the bytes (all-reduce) or (n-1)/n (reduce-scatter, all-
gather) and pays its latency 2 (n-1) or (n-1) times; the profile's reduce_scatter_ratio and all_gather_ratio
scale the latter two where the backend's are no rings (gloo). A group whose ranks span nodes uses the inter-node
link (mesh order dp, pp, cp, tp: tp is innermost). A rank's tokens are seq_len / cp of each sequence. On a CPU
profile with `cores`, ranks beyond the node's cores share them: a rank's work runs at one core's speed, but the
node's ranks together get only `cores` cores, so a step takes at least the node's busy time / cores
(ranks_per_node / cores x one rank's) -- and a pipeline's bubble costs less than on devices of their own, as an
idle rank yields its core to a busy one; and the data-parallel reduction is not overlapped (gloo reduces on the
same cores the backward needs), and each chunk's pipeline send and receive is charged to its F and B.
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

from pipetrain.config import Recipe
from pipetrain.models import flops_per_token
from pipetrain.parallel.mesh.rules import resolve_dp
from pipetrain.parallel.pipeline.stage import layer_costs
from pipetrain.plan.devices import DeviceProfile
from pipetrain.plan.in_flight import schedule_shape, zbv_stage_costs
from pipetrain.plan.memory import FP32, MOMENTS, model_state_bytes, rank_tokens, zero3_gather_bytes
from pipetrain.plan.shapes import kv_rows, rank_stages


# Bytes of memory traffic per updated parameter in one step: the gradient-norm read (4), AdamW's reads of
# parameter, gradient and two moments (16) and writes of parameter and moments (12), and foreach temporaries (8).
OPTIMIZER_BYTES = 40


@dataclass(frozen=True)
class StepTime:
    compute: float        # seconds of matmul work on the busiest rank (no bubble)
    tp_comm: float        # exposed tp collectives
    pp_comm: float        # p2p transfers on the fill / drain path
    bubble: float         # seconds idle in the pipeline (from the simulator)
    bubble_fraction: float
    cp_comm: float        # exposed K/V all-gathers and gradient reduce-scatters over cp
    ep_comm: float        # expert-parallel all-to-alls (dispatch + combine, forward and backward)
    dp_comm: float        # total dp collective time
    dp_exposed: float     # the part not hidden behind the last backward
    optimizer: float      # gradient norm and AdamW update of this rank's shard
    total: float
    tokens_per_s: float

    def as_dict(self) -> dict:
        return asdict(self)


def backward_ratio(recipe: Recipe) -> float:
    """B / F of a block: 2, or 3 when full recompute reruns the forward inside the backward."""
    return 3.0 if recipe.parallel.recompute == "full" else 2.0


def activation_width(recipe: Recipe) -> int:
    """Bytes per element of the activations the collectives move: bf16 under autocast (bf16 and fp8 runs: fp8's
    linears return the autocast dtype, parallel/tensor/fp8.py), else fp32."""
    return 2 if recipe.train.precision in ("bf16", "fp8") else FP32


def _ring(n: int, nbytes: float, bw: float, latency: float, steps_factor: float) -> float:
    """A ring collective of n ranks: steps_factor 2 for all-reduce, 1 for reduce-scatter / all-gather."""
    if n <= 1:
        return 0.0
    return steps_factor * ((n - 1) / n * nbytes / bw + (n - 1) * latency)


def _link(profile: DeviceProfile, span: int, ranks_per_node: int) -> tuple[float, float]:
    """(bandwidth, latency) of a group whose members lie `span` global ranks apart end to end."""
    if span > ranks_per_node:
        return profile.inter_bw, profile.inter_latency
    return profile.intra_bw, profile.intra_latency


def a2a_bytes(recipe: Recipe, world_size: int) -> int:
    """Bytes one rank sends in one expert-parallel all-to-all of a microbatch: its k routed copies of each
    of its tokens (T/cp of every sequence under cp), (ep-1)/ep of them to other ranks under balanced routing."""
    m, p = recipe.model, recipe.parallel
    micro_tokens = rank_tokens(recipe, world_size)
    return int(micro_tokens * m.num_experts_per_tok * m.d_model * activation_width(recipe) * (p.ep - 1) / p.ep)


def all_to_all_seconds(n: int, nbytes: float, bw: float, latency: float) -> float:
    """One all-to-all over n ranks sending nbytes off-rank: pairwise exchanges, n-1 latencies."""
    return nbytes / bw + (n - 1) * latency


def step_time(recipe: Recipe, world_size: int, profile: DeviceProfile, ranks_per_node: int | None = None,
              states: tuple[int, int, int] | None = None) -> StepTime:
    """Predicted seconds per optimizer step (and tokens/s) of recipe's layout on world_size ranks; states:
    the busiest rank's (parameter, gradient, optimizer-state) bytes, computed when not given."""
    m, p, t = recipe.model, recipe.parallel, recipe.train
    ranks_per_node = ranks_per_node or world_size
    dp = resolve_dp(recipe, world_size)
    tp, pp, v, cp = p.tp, p.pp, p.virtual_stages, p.cp
    micro_tokens = rank_tokens(recipe, world_size)
    # CPU ranks beyond the node's cores time-share them (a calibrated profile's figures are per core)
    share = max(1.0, ranks_per_node / profile.cores) if profile.cores else 1.0
    peak = profile.flops(t.precision) * profile.efficiency

    # Forward FLOPs per token of the busiest pp rank: its blocks (attention as flops_per_token counts it),
    # the head on the last stage.
    head = layer_costs(m, t.seq_len)[2]
    per_block = (flops_per_token(m, t.seq_len) / 3 - head) / m.n_layers
    loads = []
    for r in range(pp):
        layers, _, last, _ = rank_stages(recipe, r)
        loads.append(len(layers) * per_block + (head if last else 0.0))
    busiest = max(range(pp), key=loads.__getitem__)
    layers_busiest = len(rank_stages(recipe, busiest)[0])
    fwd = micro_tokens * loads[busiest] / tp / peak
    extra_fwd = micro_tokens * layers_busiest * per_block / tp / peak if p.recompute == "full" else 0.0
    if p.recompute == "selective":  # the attention core's forward again: 4 Hq K T/2 per token per block
        extra_fwd = micro_tokens * layers_busiest * 2 * m.n_heads * m.head_dim * t.seq_len / tp / peak

    # tp: 4 collectives per block per microbatch on the (B, T, D) activation
    act_bytes = micro_tokens * m.d_model * activation_width(recipe)
    bw, lat = _link(profile, tp, ranks_per_node)
    tp_fwd = 2 * layers_busiest * _ring(tp, act_bytes, bw, lat, 2)
    if p.sequence_parallel:  # a reduce-scatter and an all-gather in place of each all-reduce
        tp_fwd *= (profile.reduce_scatter_ratio + profile.all_gather_ratio) / 2
    # ep: two all-to-alls (dispatch, combine) per MoE block forward, their reverses backward
    ep_fwd = 0.0
    if p.ep > 1 and m.is_moe:
        bw_ep, lat_ep = _link(profile, p.ep * pp * cp * tp, ranks_per_node)  # ep: dp ranks, pp * cp * tp apart
        ep_fwd = 2 * layers_busiest * all_to_all_seconds(p.ep, a2a_bytes(recipe, world_size), bw_ep, lat_ep)
    # dispatch: about 20 operator calls per block forward, 2x that backward (matters on CPU and tiny models)
    launch = 20 * layers_busiest * profile.op_overhead
    fwd += launch
    # cp: K and V of the whole sequence gathered per block (B x T = cp x this rank's tokens), their
    # gradients reduce-scattered backward; a recompute reruns the gather inside the backward
    kv_bytes = 2 * micro_tokens * cp * kv_rows(m, tp) * activation_width(recipe)
    bw_cp, lat_cp = _link(profile, tp * cp, ranks_per_node)
    cp_fwd = layers_busiest * _ring(cp, kv_bytes, bw_cp, lat_cp, 1) * profile.all_gather_ratio
    cp_bwd = (layers_busiest * _ring(cp, kv_bytes, bw_cp, lat_cp, 1) * profile.reduce_scatter_ratio
              + (cp_fwd if p.recompute != "none" else 0.0))
    f_cost = fwd + tp_fwd + cp_fwd + ep_fwd
    b_cost = 2 * fwd + extra_fwd + tp_fwd + (tp_fwd if p.recompute == "full" else 0.0) + cp_bwd + ep_fwd

    if pp > 1:
        bw_pp, lat_pp = _link(profile, tp * pp, ranks_per_node)
        boundary = micro_tokens // (tp if p.sequence_parallel and tp > 1 else 1) * m.d_model * FP32
        hop = boundary / bw_pp + lat_pp
        if profile.cores:  # gloo on CPU: every send / receive of a chunk's F and B costs the rank's own core
            f_cost += v * hop
            b_cost += v * hop
        # simulated at the nominal B/F (cached across layouts), scaled to this layout's F + B
        ratio = backward_ratio(recipe)
        makespan_unit, _ = schedule_shape(p.schedule, pp, p.microbatches, v, p.split_backward, ratio,
                                          zbv_stage_costs(recipe))
        makespan_unit *= (f_cost + b_cost) / (1 + ratio) / f_cost
        pp_comm = 2 * (pp - 1) * v * hop
        pipeline = makespan_unit * f_cost + pp_comm
    else:
        pp_comm = 0.0
        pipeline = p.microbatches * (f_cost + b_cost)
    busy = p.microbatches * (f_cost + b_cost)
    bubble = max(0.0, pipeline - pp_comm - busy)
    if share > 1:  # shared cores: the node's work / its cores bounds the step; the bubble shrinks into it
        pipeline = max(pipeline, busy * share)
        bubble = max(0.0, pipeline - pp_comm - busy * share)
        busy *= share

    # dp: this rank's gradients, reduced once per step over dp x cp
    if states is None:
        states = model_state_bytes(recipe, world_size, busiest)
    grad_bytes = states[0]
    gather_bytes = grad_bytes
    if p.zero == 3 and dp > 1:  # states[0] is the rank's rows plus two units: the collectives move every parameter
        grad_bytes = model_state_bytes(dataclasses.replace(recipe, parallel=dataclasses.replace(p, zero=0)),
                                       world_size, busiest)[0]
        forward_bytes, backward_bytes = zero3_gather_bytes(recipe, busiest)  # bf16: linear weights in bf16
        gather_bytes = (forward_bytes + backward_bytes) / 2 if p.reshard_after_forward else forward_bytes  # per pass
    optimizer = states[2] / MOMENTS / FP32 * OPTIMIZER_BYTES / profile.mem_bw * share
    bw_dp, lat_dp = _link(profile, world_size, ranks_per_node)
    dp *= cp  # the gradient group (ParallelDims.dp_cp_group), and ZeRO's shard group
    zero = p.zero if dp > 1 else 0
    if zero >= 2:
        reduce = _ring(dp, grad_bytes, bw_dp, lat_dp, 1) * profile.reduce_scatter_ratio
    else:
        reduce = _ring(dp, grad_bytes, bw_dp, lat_dp, 2)
    gather = _ring(dp, gather_bytes, bw_dp, lat_dp, 1) * profile.all_gather_ratio if zero >= 1 else 0.0
    # on a CPU profile gloo's reductions run on the ranks' own cores: nothing hides behind the backward
    exposed = (reduce if profile.cores else max(0.0, reduce - b_cost)) + (gather if zero < 3 else 0.0)
    if zero == 3:  # parallel/data/zero3.py: each unit gathered in every forward and backward pass, prefetched
        gather *= 2 * p.microbatches if p.reshard_after_forward else 1
        if profile.cores:
            exposed = reduce + gather
        else:  # a pass's first unit waits for its own gather; the rest, and the reduce-scatter, share the link
            layers, first, last, _ = rank_stages(recipe, busiest)  # behind the step's compute
            exposed = gather / max(1, len(layers) + first + last) + max(0.0, reduce + gather - busy)
    total = pipeline + exposed + optimizer
    cp_comm = p.microbatches * (cp_fwd + cp_bwd) * share
    ep_comm = p.microbatches * 2 * ep_fwd * share
    tp_comm = p.microbatches * (2 * tp_fwd + (tp_fwd if p.recompute == "full" else 0.0)) * share
    return StepTime(compute=busy - tp_comm - cp_comm - ep_comm, tp_comm=tp_comm, pp_comm=pp_comm, bubble=bubble,
                    bubble_fraction=bubble / pipeline if pipeline else 0.0, cp_comm=cp_comm, ep_comm=ep_comm,
                    dp_comm=reduce + gather,
                    dp_exposed=exposed, optimizer=optimizer, total=total,
                    tokens_per_s=t.global_batch * t.seq_len / total)
