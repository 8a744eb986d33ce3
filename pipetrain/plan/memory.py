"""Per-rank memory of a layout, from formulas: model states exactly, activations by counting saved tensors.

Model states (exact for the parameter and AdamW tensors a run allocates, see tests/unit/test_plan_memory.py):
parameters are fp32 and are the master weights (train.precision=bf16 autocasts compute only), gradients are
fp32, AdamW keeps two fp32 moments. A rank holds its pp stage(s)' layers, split tp ways the way
parallel/tensor/layers.py splits them (column: output rows / tp, row: input columns / tp with the bias replicated,
kv: split when tp divides n_kv_heads, else replicated; embedding and head: vocab rows / tp; norms
replicated). The tied head on a last stage that is not on the first stage's rank is a copy. ZeRO shards
each parameter's dim 0 in dp row ranges (parallel.data.zero.dp_row_ranges); dp rank 0 holds the largest, the ceiling.

Activations: the bytes autograd saves for backward per microbatch, listed tensor by tensor from what the
decoder saves (docs/planner.md has the list), times the most (microbatch, chunk) units the schedule holds
at once (schedules.peak_in_flight of the simulated action lists). Legend: B microbatch sequences, T
seq_len, D d_model, Hq/Hkv heads, K head dim, F ffn, V vocab.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import asdict, dataclass

from pipetrain.config import ModelConfig, ParallelConfig, Recipe
from pipetrain.parallel.data.allreduce import DEFAULT_BUCKET_BYTES
from pipetrain.parallel.mesh.rules import resolve_dp
from pipetrain.parallel.pipeline.stage import stage_layout
from pipetrain.parallel.pipeline.schedules import build_all_schedules, peak_in_flight, placement_of, rank_chunk_of, simulate
from pipetrain.parallel.data.zero import MAX_IN_FLIGHT

FP32 = 4
MOMENTS = 2  # AdamW exp_avg, exp_avg_sq


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds at its peak, by kind (comm: reduction buckets and p2p buffers)."""
    pp_rank: int
    params: int
    grads: int
    optim: int
    activations: int
    comm: int
    step_temp: int = 0       # the optimizer step's temporaries (foreach AdamW: sqrt of the second moment)
    recompute_temp: int = 0  # full recompute: one block's activations, recomputed inside its backward
    deferred_w: int = 0      # split backward: weight-gradient operands a chunk holds until W, beyond saved ones
    grads_live: int = 0      # gradient bytes live beside the peak activations (earlier microbatches' backwards)
    full_grads: int = 0      # gradient bytes before the reduction (ZeRO 2 frees all but the shard after it)
    gather: int = 0          # ZeRO 1/2: the buffers of the parameter all-gather after the AdamW update

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optim

    @property
    def total(self) -> int:
        """Peak bytes: parameters and optimizer state always, plus the largest of three phases. Gradients are
        freed at every step's start (zero_grad(set_to_none=True)), so the forward's peak holds the activations
        in flight with only the gradients earlier microbatches made; the end of the backward holds the full
        gradients and the reduction buffers; the optimizer step the reduced gradients and AdamW's
        temporaries, then ZeRO's all-gather buffers."""
        forward = self.activations + self.recompute_temp + self.deferred_w + self.grads_live + self.comm
        backward_end = self.full_grads + self.comm
        step = self.grads + max(self.step_temp, self.gather)  # AdamW's temporaries are freed before the gather
        return self.params + self.optim + max(forward, backward_end, step)

    def as_dict(self) -> dict:
        return {**asdict(self), "model_states": self.model_states, "total": self.total}


def _kv_rows(m: ModelConfig, tp: int) -> int:
    """Rows of wk / wv a tp rank holds: its share of the kv heads, or all of them when replicated."""
    return m.kv_heads * m.head_dim // tp if m.kv_heads % tp == 0 else m.kv_heads * m.head_dim


def param_shapes(m: ModelConfig, tp: int, layers: list[int], first: bool, last: bool,
                 tied_copy: bool) -> list[tuple[int, ...]]:
    """Local shapes of the parameters of one rank holding `layers` (and the embedding if first, the final
    norm and head if last; the head is a copy of the tied embedding when tied_copy)."""
    D, K, Fh, V = m.d_model, m.head_dim, m.ffn, m.vocab_size
    gpt2 = m.family == "gpt2"
    qkv_bias = m.has_qkv_bias or gpt2
    norm = [(D,), (D,)] if gpt2 else [(D,)]
    q_rows, kv_rows = m.n_heads * K // tp, _kv_rows(m, tp)
    block = norm + [(q_rows, D), (kv_rows, D), (kv_rows, D), (D, m.n_heads * K // tp)]
    block += [(q_rows,), (kv_rows,), (kv_rows,)] if qkv_bias else []
    block += [(D,)] if gpt2 else []  # wo bias, replicated
    block += norm + ([] if gpt2 else [(Fh // tp, D)]) + [(Fh // tp, D), (D, Fh // tp)]
    block += [(Fh // tp,), (D,)] if gpt2 else []  # up bias split, down bias replicated
    shapes = []
    if first:
        shapes.append((V // tp, D))
        if gpt2:
            shapes.append((m.max_seq_len, D))
    shapes += block * len(layers)
    if last:
        shapes += norm
        if not m.tied or tied_copy:
            shapes.append((V // tp, D))
    return shapes


def model_params(m: ModelConfig) -> int:
    """Parameters of the whole model (count_params of a build), by arithmetic: no layer is built, so a
    size check on a recipe with a million layers answers at once."""
    ends = sum(_numel(s) for s in param_shapes(m, 1, [], True, True, False))
    block = sum(_numel(s) for s in param_shapes(m, 1, [0], False, False, False))
    return ends + m.n_layers * block


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _rows_numel(shape: tuple[int, ...], dp: int) -> int:
    """Elements of dp rank 0's row shard (the largest) of a parameter of this local shape."""
    rows = -(-shape[0] // dp)  # dp_row_ranges gives rank 0 the ceiling
    return rows * _numel(shape) // shape[0]


@functools.lru_cache(maxsize=1024)
def _stages(m: ModelConfig, pp: int, virtual_stages: int, stage_layers: tuple | None, seq_len: int,
            schedule: str) -> tuple:
    """pipeline.stage_layout, cached: the search asks for the same split for many layouts. m must be
    hashable (_hashable_model)."""
    pcfg = ParallelConfig(pp=pp, virtual_stages=virtual_stages, schedule=schedule,
                          stage_layers=list(stage_layers) if stage_layers else None)
    return tuple(tuple(s) for s in stage_layout(m, pcfg, seq_len))


def _hashable_model(m: ModelConfig) -> ModelConfig:
    """m with its list fields as tuples, so it can key a cache (a frozen dataclass with a list does not hash)."""
    return dataclasses.replace(m, **{f.name: tuple(getattr(m, f.name)) for f in dataclasses.fields(m)
                                     if isinstance(getattr(m, f.name), list)})


def rank_stages(recipe: Recipe, pp_rank: int) -> tuple[list[int], bool, bool, bool]:
    """(global layers, holds stage 0, holds the last stage, holds a tied head copy) of a pp rank."""
    p = recipe.parallel
    stages = _stages(_hashable_model(recipe.model), p.pp, p.virtual_stages, tuple(p.stage_layers or ()) or None,
                     recipe.train.seq_len, p.schedule)
    num_stages = len(stages)
    placement = placement_of(p.schedule)
    mine = [s for s in range(num_stages) if rank_chunk_of(s, p.pp, placement)[0] == pp_rank]
    first, last = 0 in mine, num_stages - 1 in mine
    return [i for s in mine for i in stages[s]], first, last, recipe.model.tied and last and not first


def model_state_bytes(recipe: Recipe, world_size: int, pp_rank: int) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes of dp rank 0 at this pp rank, after reduce_grads."""
    p = recipe.parallel
    dp = resolve_dp(recipe, world_size)
    layers, first, last, copy = rank_stages(recipe, pp_rank)
    shapes = param_shapes(recipe.model, p.tp, layers, first, last, copy)
    full = sum(map(_numel, shapes))
    shard = sum(_rows_numel(s, dp) for s in shapes) if dp > 1 else full
    zero = p.zero if dp > 1 else 0
    if zero == 3:  # parallel/data/zero3.py: rows of everything, plus the two largest units (block, embed, head)
        block, embed, head = (([layers[0]] if layers else [], False, False, False), ([], first, False, False),
                              ([], False, last, copy))
        units = [sum(map(_numel, param_shapes(recipe.model, p.tp, *args))) for args in (block, block, embed, head)]
        return FP32 * (shard + sum(sorted(units)[-2:])), FP32 * shard, FP32 * MOMENTS * shard
    grads = shard if zero == 2 else full
    optim = shard if zero >= 1 else full
    return FP32 * full, FP32 * grads, FP32 * MOMENTS * optim


def saved_bytes_per_token(m: ModelConfig, tp: int, seq_len: int, sequence_parallel: bool,
                          recompute: str) -> tuple[float, float, float]:
    """(one block, the first stage's extras, the last stage's extras) bytes saved for backward per token.

    Per block (fp32 elements per token, none): the norm's input, statistics and output and the flattened
    copy its linear saves; q, k, v (after RoPE), the attention output and its log-sum-exp; the same norm
    group before the MLP; gate, up, their SwiGLU product and its flattened copy (gpt2: the GELU input and
    its output). RoPE's cos/sin tables (T x K each) are saved per block and per sequence position.
    selective drops the log-sum-exp (the attention core's own saved state); full keeps the block input."""
    D, K, Fh, V = m.d_model, m.head_dim, m.ffn, m.vocab_size
    gpt2 = m.family == "gpt2"
    sp = tp if sequence_parallel and tp > 1 else 1
    stats = 2 if gpt2 else 1                       # LayerNorm: mean and rstd; RMSNorm: rstd
    norm_group = (D + stats + (0 if gpt2 else D)) / sp + D  # x, stats, (RMSNorm output), flattened input
    q, kv = m.n_heads * K / tp, _kv_rows(m, tp)
    lse = m.n_heads / tp
    attn = norm_group + q + 2 * kv + q + lse + (0 if gpt2 else 2 * K)  # rope tables amortised below
    mlp = norm_group + (2 * Fh / tp if gpt2 else 4 * Fh / tp)
    if recompute == "full":
        block = D / sp
    elif recompute == "selective":
        block = attn + mlp - lse
    else:
        block = attn + mlp
    first = 2.0  # token ids, int64 (2 fp32 words)
    last = (D + stats + (0 if gpt2 else D)) / sp + D + V / tp + 2  # final norm group, fp32 logits, targets
    return FP32 * block, FP32 * first, FP32 * last


def activation_bytes(recipe: Recipe, world_size: int, pp_rank: int, in_flight: int | None = None) -> int:
    """Bytes saved for backward that this pp rank holds at its peak: per-microbatch bytes of one chunk
    times the (microbatch, chunk) units in flight. in_flight None: from the schedule. bf16 halves the
    block's tensors and adds the autocast weight copies (an estimate the tests check only in fp32)."""
    m, p, t = recipe.model, recipe.parallel, recipe.train
    dp = resolve_dp(recipe, world_size)
    micro = max(1, t.global_batch // (dp * p.microbatches))
    tokens = micro * t.seq_len
    block, first_extra, last_extra = saved_bytes_per_token(m, p.tp, t.seq_len, p.sequence_parallel, p.recompute)
    weight_casts = 0
    if t.precision == "bf16":  # autocast saves bf16 matmul inputs and the bf16 copies of the weights
        block /= 2
        if p.recompute != "full":
            params = model_state_bytes(recipe, world_size, pp_rank)[0]
            weight_casts = params // 2 // p.virtual_stages  # 2 of 4 bytes, one chunk's share
    rope = 0 if m.family == "gpt2" else FP32 * 2 * t.seq_len * m.head_dim  # cos/sin per block, not per sequence
    if p.recompute == "full":
        rope = 0
    layers, first, last, _ = rank_stages(recipe, pp_rank)
    per_chunk_layers = len(layers) / p.virtual_stages
    unit = tokens * block * per_chunk_layers + rope * per_chunk_layers + weight_casts
    if in_flight is None:
        in_flight = schedule_in_flight(recipe)[pp_rank]
    extra = tokens * ((first_extra if first else 0) + (last_extra if last else 0))
    # The first / last stage's extras live with their own chunk's units only; with one chunk per rank that
    # is every unit, interleaved it is about one in virtual_stages.
    extra_units = in_flight if p.virtual_stages == 1 else max(1, in_flight // p.virtual_stages)
    return int(unit * in_flight + extra * extra_units)


def schedule_in_flight(recipe: Recipe) -> list[int]:
    """Most (microbatch, chunk) activations each pp rank holds at once under the recipe's schedule."""
    p = recipe.parallel
    if p.pp == 1:
        return [1]  # forward and backward of one microbatch at a time
    return list(schedule_shape(p.schedule, p.pp, p.microbatches, p.virtual_stages, p.split_backward,
                               3.0 if p.recompute == "full" else 2.0)[1])


@functools.lru_cache(maxsize=4096)
def schedule_shape(schedule: str, pp: int, microbatches: int, virtual_stages: int, split_backward: bool,
                   backward_cost: float) -> tuple[float, tuple[int, ...]]:
    """(makespan at F = 1, peak in-flight units per rank) of the schedule; cached: the search asks often."""
    with warnings.catch_warnings():  # 1f1b with microbatches < pp warns; the search scores it instead
        warnings.simplefilter("ignore")
        actions = build_all_schedules(schedule, pp, microbatches, virtual_stages, backward_cost=backward_cost,
                                      split_backward=split_backward)
    result = simulate(actions, cost_f=1.0, cost_b=backward_cost, virtual_stages=virtual_stages,
                      placement=placement_of(schedule))
    return result.makespan, tuple(peak_in_flight(a) for a in actions)


def comm_bytes(recipe: Recipe, world_size: int, grad_bytes: int) -> int:
    """Transient communication buffers: gradient reduction buckets in flight (dp > 1; never more than the
    gradients they hold) and the p2p send and receive buffers of activations and gradients (pp > 1)."""
    p, t, m = recipe.parallel, recipe.train, recipe.model
    dp = resolve_dp(recipe, world_size)
    total = 0
    if dp > 1:
        buckets = min(MAX_IN_FLIGHT * DEFAULT_BUCKET_BYTES, grad_bytes)
        total += buckets + (buckets // dp if p.zero == 2 else 0)  # ZeRO 2: the reduce-scatter's output too
    if p.pp > 1:
        micro = max(1, t.global_batch // (dp * p.microbatches))
        seq = t.seq_len // (p.tp if p.sequence_parallel and p.tp > 1 else 1)
        total += 4 * FP32 * micro * seq * m.d_model  # send/recv x activation/gradient
    return total


def recompute_bytes(recipe: Recipe, world_size: int, pp_rank: int) -> int:
    """Full recompute: the backward of a block first reruns its forward, so one block's activations of one
    microbatch (as saved without recompute) are live on top of the stored block inputs."""
    p = recipe.parallel
    if p.recompute != "full" or not rank_stages(recipe, pp_rank)[0]:
        return 0
    m, t = recipe.model, recipe.train
    tokens = max(1, t.global_batch // (resolve_dp(recipe, world_size) * p.microbatches)) * t.seq_len
    block = saved_bytes_per_token(m, p.tp, t.seq_len, p.sequence_parallel, "none")[0]
    rope = 0 if m.family == "gpt2" else FP32 * 2 * t.seq_len * m.head_dim
    return int((tokens * block + rope) / (2 if t.precision == "bf16" else 1))


def deferred_w_bytes(recipe: Recipe, world_size: int, pp_rank: int) -> int:
    """With the backward split (split_backward, and always for the V schedules), a chunk's input-gradient
    passes leave every linear's weight-gradient operands for its deferred W: the output gradients, which are
    no saved activation, and under full recompute the inputs too (otherwise saved activations already). One
    chunk's worth: W runs before the next chunk's backward would add more on most ranks."""
    p = recipe.parallel
    layers = rank_stages(recipe, pp_rank)[0]
    if not layers or p.pp == 1 or not (p.split_backward or placement_of(p.schedule) == "v"):
        return 0
    m, t = recipe.model, recipe.train
    tokens = max(1, t.global_batch // (resolve_dp(recipe, world_size) * p.microbatches)) * t.seq_len
    inputs, grads = weight_grad_operand_bytes(m, p.tp)
    per_token = grads + (inputs if p.recompute == "full" else 0)
    return int(tokens * per_token * len(layers) / p.virtual_stages / (2 if t.precision == "bf16" else 1))


def weight_grad_operand_bytes(m: ModelConfig, tp: int) -> tuple[float, float]:
    """(inputs, output gradients): bytes per token of one block's linears' weight-gradient operands with tp's
    shards: the inputs are the two norm outputs, the attention output and the MLP's hidden product; the
    output gradients those of q, k, v, the attention projection, gate and up (gpt2: fc) and the MLP output."""
    D, Fh = m.d_model, m.ffn
    q, kv = m.n_heads * m.head_dim / tp, _kv_rows(m, tp)
    hidden = Fh / tp
    inputs = D + D + q + hidden
    grads = q + 2 * kv + D + (hidden if m.family == "gpt2" else 2 * hidden) + D
    return FP32 * inputs, FP32 * grads


def _gather_bytes(recipe: Recipe, world_size: int, param_bytes: int, staged: bool) -> int:
    """ZeRO 1/2 all-gather the updated rows bucket by bucket, at most two in flight: each a full flat bucket
    and this rank's part. staged: the backend gathers into a flat copy of its own, then copies it into the
    output (gloo's all_gather_into_tensor does; NCCL writes in place): one more bucket, measured on gloo as
    the gather's transient going from 39 to 63 MiB at 26 MiB of parameters per rank."""
    dp = resolve_dp(recipe, world_size)
    if dp == 1 or recipe.parallel.zero == 0:
        return 0
    buckets = min(MAX_IN_FLIGHT * DEFAULT_BUCKET_BYTES, param_bytes)
    staging = min(DEFAULT_BUCKET_BYTES, param_bytes) if staged else 0
    return buckets + buckets // dp + staging


def _grads_beside_activations(recipe: Recipe, grad_bytes: int, acts: int, in_flight: int) -> int:
    """Gradients live when the activations peak. Without pipelining, microbatches run one after the other,
    so from the second one on the full gradients sit beside one microbatch's activations. A pipeline's
    activations peak at the end of its warm-up, before the first backward; later peaks hold one unit fewer
    beside the gradients: max(acts, grads + acts (u - 1) / u) - acts."""
    p = recipe.parallel
    if p.pp == 1:
        return grad_bytes if p.microbatches > 1 else 0
    return int(max(0.0, grad_bytes - acts / in_flight)) if in_flight else grad_bytes


def rank_memory(recipe: Recipe, world_size: int, in_flight: list[int] | None = None,
                staged_collectives: bool = False) -> list[RankMemory]:
    """Every pp rank's predicted peak memory (dp rank 0, tp rank 0). staged_collectives: the backend copies
    collective outputs through buffers of its own (gloo, on CPU; DeviceProfile.staged_collectives)."""
    in_flight = in_flight or schedule_in_flight(recipe)
    out = []
    for r in range(recipe.parallel.pp):
        params, grads, optim = model_state_bytes(recipe, world_size, r)
        acts = activation_bytes(recipe, world_size, r, in_flight[r])
        out.append(RankMemory(r, params, grads, optim, acts, comm_bytes(recipe, world_size, params),
                              step_temp=optim // MOMENTS, recompute_temp=recompute_bytes(recipe, world_size, r),
                              deferred_w=deferred_w_bytes(recipe, world_size, r),
                              grads_live=_grads_beside_activations(recipe, params, acts, in_flight[r]),
                              full_grads=params,
                              gather=_gather_bytes(recipe, world_size, params, staged_collectives)))
    return out
