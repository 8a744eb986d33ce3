"""Per-rank memory of a layout, from formulas: model states exactly, activations by counting saved tensors.

Model states (exact for the parameter and AdamW tensors a run allocates, see tests/unit/test_plan_memory.py):
parameters are fp32 and are the master weights (train.precision=bf16 autocasts compute only), gradients are
fp32, AdamW keeps two fp32 moments. A rank holds its pp stage(s)' layers with the local shapes pipetrain.plan.shapes
gives (tp's splits, experts / ep). ZeRO shards each parameter's dim 0 in dp row ranges
(parallel.data.zero.dp_row_ranges); dp rank 0 holds the largest, the ceiling.
Expert parallelism (parallel.ep) keeps num_experts/ep experts per rank; ZeRO shards them over expert-dp
(dp/ep ranks, times cp under cp: parallel/expert/zero.py), the rest over dp (times cp); under HSDP over one
replica's dp_shard/ep and dp_shard ranks.

Activations: the bytes autograd saves for backward per microbatch, listed tensor by tensor from what the
decoder saves (docs/planner.md has the list), times the most (microbatch, chunk) units the schedule holds
at once (plan/in_flight.py, from the simulated action lists). Legend: B microbatch sequences, T
seq_len, D d_model, Hq/Hkv heads, K head dim, F ffn, V vocab.

The replica modes (parallel/replicas/stale.py, periodic.py) add what their exchange holds: ssp / dssp keep the summed
gradients of the clocks not yet applied (staleness s of them between steps, s + 1 while the update runs);
DiLoCo keeps global parameters and the outer momentum beside the rank's (shard of the) parameters and its
outer step holds the pseudo-gradient and its averaged copy; local SGD averages a flat copy of the
parameters; every wrapped mode sums its gradients through a flat copy. Dynamic batch sizing
(parallel/replicas/dbs.py) sizes the schedule by the largest share a replica can be given. With parameter
servers (parallel/ps/) the workers hold no input embedding, only the step's compact tables; each server
holds its rows, their AdamW moments and a dense gradient of them (server_memory). This one model is what
the pre-flight check (pipetrain.preflight), train.py --dry-run and parallel.auto report (run_memory).
"""
from __future__ import annotations

from types import SimpleNamespace
from dataclasses import asdict, dataclass, replace

from pipetrain.config import ModelConfig, Recipe, fp8_weights_once_a_run, fused_loss_on
from pipetrain.parallel.data.allreduce import DEFAULT_BUCKET_BYTES
from pipetrain.parallel.mesh.rules import resolve_dp, resolve_dp_shard
from pipetrain.parallel.pipeline.schedules import placement_of
from pipetrain.parallel.data.zero import MAX_IN_FLIGHT
from pipetrain.parallel.ps.protocol import row_range
from pipetrain.parallel.replicas.wrapped import needs_replica_sync, sync_mode
from pipetrain.plan.in_flight import busiest_microbatches, end_chunks_in_flight, schedule_in_flight
from pipetrain.plan.loss import fused_loss_bytes, fused_loss_weight_grad, loss_backward_bytes
from pipetrain.plan.precision import FP32, fp8_linear_elements, fp8_linear_input_savings, loss_dtype_bytes, triton_path
from pipetrain.plan.shapes import (expert_shapes, kv_rows, lora_elements, numel, param_shapes, rank_stage_layers,
                                   rank_stages, rows_numel)

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
    replica_state: int = 0   # DiLoCo: the global parameters and the outer momentum, kept for the whole run
    pending: int = 0         # ssp / dssp: summed gradients of clocks not yet applied, held between steps
    exchange_temp: int = 0   # the flat gradient the replica exchange installs, alive while the update runs
    sync_temp: int = 0       # after the update: local SGD's flat copy, DiLoCo's pseudo-gradient and its
                             # average; a server: the squared norm's fp64 copies (bsp), the scaled push (async)
    loss_temp: int = 0       # the last stage's loss backward: the logits and two gradients of their size (fused:
                             # its forward's chunk buffer, fused_loss_bytes)
    ps_tables: int = 0       # a worker under parameter servers: the step's compact rows, their gradient, the
                             # next step's prefetched rows
    weight_cache: int = 0    # fp8 with several microbatches: the float8 weights quantised once a run (1 byte an
                             # element, 2 on the hardware: fp8.Fp8WeightCache), held for the whole run
    role: str = "worker"     # "worker" (pp_rank is its pp rank) or "server" (pp_rank is the server index)

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optim + self.replica_state

    @property
    def total(self) -> int:
        """Peak bytes: parameters, optimizer and replica state, pending gradients and pulled rows always, plus the
        largest of three phases. Gradients are freed at every step's start (zero_grad(set_to_none=True)), so the
        forward's peak (up to the loss's backward) holds the activations in flight with only the gradients earlier
        microbatches made; the end of the backward the full gradients and the reduction buffers; the optimizer
        step the reduced gradients and AdamW's temporaries (beside the exchanged gradient), then ZeRO's
        all-gather buffers or the replicas' parameter exchange."""
        # the loss's backward starts before any gradient of its microbatch exists, so before any reduction
        # bucket is in flight: its temporaries and the buffers are not live together
        forward = (self.activations + self.recompute_temp + self.deferred_w + self.grads_live
                   + max(self.comm, self.loss_temp))
        backward_end = self.full_grads + self.comm
        step = self.grads + max(self.step_temp + self.exchange_temp, self.gather, self.sync_temp)
        held = self.params + self.optim + self.replica_state + self.pending + self.ps_tables + self.weight_cache
        return held + max(forward, backward_end, step)

    def as_dict(self) -> dict:
        return {**asdict(self), "model_states": self.model_states, "total": self.total}


def zero_shards(recipe: Recipe, world_size: int) -> int:
    """The ranks ZeRO shards model states over: dp_shard (all of dp by default) times cp
    (ParallelDims.zero_shard) when parallel.zero >= 1 and that exceeds 1 (build_optimizer's rule), else 1."""
    p = recipe.parallel
    shard = resolve_dp_shard(p, resolve_dp(recipe, world_size)) * p.cp
    return shard if p.zero >= 1 and shard > 1 else 1


def rank_tokens(recipe: Recipe, world_size: int) -> int:
    """Tokens of one microbatch on one rank: its sequences times seq_len, over cp (each cp rank holds a
    T/cp slice of every sequence; parallel/context/slicing.py)."""
    p, t = recipe.parallel, recipe.train
    return max(1, t.global_batch // (resolve_dp(recipe, world_size) * p.microbatches)) * t.seq_len // p.cp


def model_state_bytes(recipe: Recipe, world_size: int, pp_rank: int) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes of dp rank 0 at this pp rank, after reduce_grads.
    Arithmetic per kind of tensor (the ends, one block times the layers), so a million layers is instant."""
    p, m = recipe.parallel, recipe.model
    shards = zero_shards(recipe, world_size)
    layers, first, last, copy = rank_stages(recipe, pp_rank)
    ends = param_shapes(m, p.tp, [], first, last, copy, servers=p.ps_servers > 0)
    block = param_shapes(m, p.tp, [0], False, False, False, ep=p.ep)
    # LoRA's adapters on top, unsharded: an upper bound (its frozen base has no gradient or moments, counted here)
    adapters = len(layers) * lora_elements(m)
    full = sum(map(numel, ends)) + len(layers) * sum(map(numel, block)) + adapters
    shard = sum(rows_numel(s, shards) for s in ends) + len(layers) * sum(rows_numel(s, shards) for s in block) \
        + adapters
    if p.ep > 1 and shards > 1:  # experts over shards / ep ranks: expert-dp (x cp), or under HSDP dp_shard / ep
        experts = expert_shapes(m, p.tp, p.ep)
        shard += len(layers) * sum(rows_numel(s, max(1, shards // p.ep)) - rows_numel(s, shards) for s in experts)
    if p.zero == 3 and shards > 1:  # parallel/data/zero3.py: rows of everything, plus two neighbouring units
        return FP32 * shard + zero3_gathered_bytes(recipe, pp_rank), FP32 * shard, FP32 * MOMENTS * shard
    grads = shard if p.zero == 2 and shards > 1 else full
    optim = shard if shards > 1 else full
    return FP32 * full, FP32 * grads, FP32 * MOMENTS * optim


def _fp32_matmul_weights(recipe: Recipe, pp_rank: int) -> tuple[int, int]:
    """(per block, head) elements of the weights ZeRO-3 keeps in fp32 although a matmul reads them: wk / wv
    replicated over tp and a tied head (their gradients are synced, parallel/data/zero3.compute_in_bf16)."""
    p, m = recipe.parallel, recipe.model
    layers, first, last, copy = rank_stages(recipe, pp_rank)
    kv = 2 * kv_rows(m, p.tp) * m.d_model if p.tp > 1 and m.kv_heads % p.tp else 0
    head = (m.vocab_size // p.tp) * m.d_model if last and m.tied else 0
    return kv, head


def zero3_unit_bytes(recipe: Recipe, pp_rank: int) -> tuple[int, int, int, int]:
    """Bytes of ZeRO-3's units gathered whole at this pp rank: (embedding, one block (0 without blocks), final
    norm + head, bytes the embedding and head units share). A tied head on the embedding's own stage is the
    embedding's table, gathered with either unit. Under train.precision=bf16 the linear weights are gathered
    and held in bf16 (parallel/data/zero3.py), the rest in fp32 (_fp32_matmul_weights among them); under fp8
    a block's linears (all fp8 linears, parallel/tensor/fp8.FP8_PLAN) at one byte, or in fp32 under a rowwise
    train.fp8_recipe (no float8 gather holds a scale per row), the head in bf16."""
    p, m, precision = recipe.parallel, recipe.model, recipe.train.precision
    low = 2 if precision in ("bf16", "fp8") else FP32
    block_low = low
    if precision == "fp8":  # fp8 refuses the replicated kv heads _fp32_matmul_weights counts
        block_low = 1 if recipe.train.fp8_recipe == "tensorwise" else FP32
    layers, first, last, copy = rank_stages(recipe, pp_rank)
    kv, _ = _fp32_matmul_weights(recipe, pp_rank)

    def size(shapes, linear_2d: bool, low: int = low) -> int:
        return sum(numel(s) * (low if linear_2d and len(s) == 2 else FP32) for s in shapes)
    embed = size(param_shapes(m, p.tp, [], first, False, False, servers=p.ps_servers > 0), False)
    block = size(param_shapes(m, p.tp, [0], False, False, False, ep=p.ep), True, block_low) + kv * (FP32 - low) \
        if layers else 0
    head = size(param_shapes(m, p.tp, [], False, last, copy), not m.tied)  # a tied head copy: fp32, synced over pp
    shared = FP32 * (m.vocab_size // p.tp) * m.d_model if first and last and m.tied and p.ps_servers == 0 else 0
    return embed, block, head + shared, shared


def zero3_gathered_bytes(recipe: Recipe, pp_rank: int) -> int:
    """The most bytes of whole parameters a pp rank holds at once under ZeRO-3: the two units next to each
    other in its unit order (parallel/data/units.UnitGatherer keeps a unit and its neighbour), or every unit
    with reshard_after_forward false; a table two units share counted once."""
    embed, block, head, shared = zero3_unit_bytes(recipe, pp_rank)
    layers, first, last, _ = rank_stages(recipe, pp_rank)
    units = ([embed] if first else []) + [block] * len(layers) + ([head] if last else [])
    if not recipe.parallel.reshard_after_forward:
        return sum(units) - shared
    pairs = [a + b for a, b in zip(units, units[1:])]
    if not layers and first and last:
        pairs = [embed + head - shared]
    return max(pairs or units or [0])


def zero3_gather_bytes(recipe: Recipe, pp_rank: int) -> tuple[int, int]:
    """Bytes a microbatch's (forward, backward) pass gathers into this pp rank: every unit once
    (zero3_unit_bytes), but the embedding only in forward (its backward reads no weight)."""
    embed, block, head, _ = zero3_unit_bytes(recipe, pp_rank)
    rest = len(rank_stages(recipe, pp_rank)[0]) * block + head
    return embed + rest, rest


def saved_bytes_per_token(m: ModelConfig, tp: int, seq_len: int, sequence_parallel: bool, recompute: str,
                          cp: int = 1, kernels: bool = False, logit_bytes: int = FP32,
                          rope_rows: bool = False, document_mask: bool = False) -> tuple[float, float, float]:
    """(one block, the first stage's extras, the last stage's extras) bytes saved for backward per token.

    Per block (fp32 elements per token, none): the norm's input, statistics and output and the flattened
    copy its linear saves; q, k, v (after RoPE), the attention output and its log-sum-exp; the same norm
    group before the MLP; gate, up, their SwiGLU product and its flattened copy (gpt2: the GELU input and
    its output). RoPE's cos/sin: the (T, K) tables once a block (_layer_bytes), or with rope_rows (cp > 1,
    data.document_mask) the rows gathered per token (2 K). document_mask: SDPA's (B, 1, T, T) mask, kept as a
    bias of q's dtype (T a token) unless the core is recomputed (selective) or cp's core checkpoints its chunks.
    selective drops the log-sum-exp (the attention core's own saved state); full keeps the block input.
    cp > 1 (per token of a rank's slice): the cp attention core (parallel/context/attention.py) checkpoints
    its chunks, so no log-sum-exp, and keeps the all-gathered K and V of the whole sequence, cp x the slice's;
    under selective recompute the core's own checkpoint keeps only the slice's q, k, v, as without cp.
    kernels: the Triton kernels run (CUDA, plan.precision.triton_path): their SwiGLU keeps gate and up only, where
    the torch reference also keeps silu(gate), and their RMSNorm x and rstd, where the reference also keeps
    x * rstd. logit_bytes: per logit the loss keeps, fp32 from the torch path's
    log-softmax, the logits' own dtype on the Triton path (train.precision's compute dtype), 0 under
    train.fused_loss, whose op keeps its input's gradient (the head's input's size) and the head's instead."""
    D, K, Fh, V = m.d_model, m.head_dim, m.active_ffn, m.vocab_size
    gpt2 = m.family == "gpt2"
    sp = tp if sequence_parallel and tp > 1 else 1
    stats = 2 if gpt2 else 1                       # LayerNorm: mean and rstd; RMSNorm: rstd
    normed = 0 if gpt2 or kernels else D  # the torch RMSNorm's x * rstd, which the Triton kernel does not keep
    norm_group = (D + stats + normed) / sp + D  # x, stats, (x * rstd), the output the linears keep
    q, kv = m.n_heads * K / tp, kv_rows(m, tp)
    lse, mask = m.n_heads / tp, (seq_len if document_mask else 0)  # log-sum-exp; document masks: SDPA's bias
    if cp > 1:  # gathered K/V instead of the slice's, and no log-sum-exp or mask (the chunks are checkpointed)
        kv, lse, mask = kv * cp, 0, 0
    attn = norm_group + q + 2 * kv + q + lse + mask + (2 * K if rope_rows and not gpt2 else 0)
    gated = 3 if kernels else 4  # gate, up, (silu(gate)), the product the down linear keeps (experts: the same)
    mlp = norm_group + (2 * Fh / tp if gpt2 else gated * Fh / tp)
    # router probabilities; each of the k copies of the token sorted to its expert and its output. Not / sp:
    # under sequence parallelism every tp rank routes and dispatches the whole sequence (gathered along T)
    if m.is_moe:
        mlp += 2 * m.num_experts + 2 * m.num_experts_per_tok * D
    if recompute == "full":
        block = D / sp
    elif recompute == "selective":
        block = attn + mlp - lse - mask
    else:
        block = attn + mlp
    first = 2.0  # token ids, int64 (2 fp32 words)
    last = (D + stats + normed) / sp + D + V / tp * logit_bytes / FP32 + 2  # final norm, logits, targets
    return FP32 * block, FP32 * first, FP32 * last


def activation_bytes(recipe: Recipe, world_size: int, pp_rank: int, in_flight: int | None = None,
                     fused_loss: bool = False, kernels: bool = False) -> int:
    """Bytes saved for backward that this pp rank holds at its peak: per-microbatch bytes of one chunk times the
    (microbatch, chunk) units in flight (in_flight None: from the schedule). bf16 and fp8 (bf16 autocast, float8
    linear inputs) halve the block's tensors and add the weight copies (plan/precision.py). fused_loss, kernels:
    train.fused_loss and the Triton kernels run. Checked against an H200's peaks (test_plan_memory_gpu.py).
    parallel.recompute_layers N: full recompute for the first N blocks of each stage, the rest keep everything."""
    m, p, t = recipe.model, recipe.parallel, recipe.train
    tokens = rank_tokens(recipe, world_size)
    logit_bytes = 0 if fused_loss else loss_dtype_bytes(recipe) if kernels else FP32
    _, first_extra, last_extra = saved_bytes_per_token(m, p.tp, t.seq_len, p.sequence_parallel, p.recompute, 1,
                                                       kernels, logit_bytes)
    layers, first, last, _ = rank_stages(recipe, pp_rank)
    per_chunk_layers = len(layers) / p.virtual_stages
    recomputed = 0.0  # blocks per chunk (on average over the rank's stages) that full recompute reruns
    if p.recompute == "full":
        n = p.recompute_layers
        recomputed = sum(len(s) if n is None else min(len(s), n) for s in rank_stage_layers(recipe, pp_rank))
        recomputed /= p.virtual_stages
    kept = replace(recipe, parallel=replace(p, recompute="none" if p.recompute == "full" else p.recompute))
    per_layer, casts = _layer_bytes(kept, world_size, pp_rank, kernels)
    unit = per_layer * (per_chunk_layers - recomputed) + casts * (1 - recomputed / per_chunk_layers if
                                                                  per_chunk_layers else p.recompute != "full")
    if recomputed:
        unit += _layer_bytes(recipe, world_size, pp_rank, kernels)[0] * recomputed
    if in_flight is None:
        in_flight = schedule_in_flight(recipe, world_size)[pp_rank]
        first_units, last_units = end_chunks_in_flight(recipe, world_size)[pp_rank]
    else:  # a caller's bound: the ends' extras live with their own chunk's units, about one in virtual_stages
        first_units = last_units = in_flight if p.virtual_stages == 1 else max(1, in_flight // p.virtual_stages)
    extra = tokens * first_extra * first_units if first else 0
    if last:
        extra += (tokens * last_extra + (fused_loss_weight_grad(recipe) if fused_loss else 0)) * last_units
        if p.recompute == "full" and t.precision in ("bf16", "fp8") and not fused_loss:  # the head is never rerun:
            extra += 2 * (m.vocab_size // p.tp) * m.d_model * last_units  # autocast keeps its bf16 weight copy
    return int(unit * in_flight + extra)


def _layer_bytes(recipe: Recipe, world_size: int, pp_rank: int, kernels: bool) -> tuple[float, int]:
    """(one block's saved bytes for one microbatch under recipe's parallel.recompute with RoPE's tables, the
    weight copies autocast keeps in bf16 and fp8: one chunk's share)."""
    m, p, t = recipe.model, recipe.parallel, recipe.train
    rope_rows = p.cp > 1 or recipe.data.document_mask  # RoPE gathers rows by position; else its tables, once a block
    block = saved_bytes_per_token(m, p.tp, t.seq_len, p.sequence_parallel, p.recompute,
                                  p.cp if p.recompute != "selective" else 1, kernels, rope_rows=rope_rows,
                                  document_mask=recipe.data.document_mask)[0]
    weight_casts = 0
    if t.precision in ("bf16", "fp8") and p.recompute != "full":  # full: the block input, fp32 residual stream
        block /= 2
        if t.precision == "fp8":
            block -= fp8_linear_input_savings(m, p.tp, p.recompute == "none" and p.cp == 1, t.compile)
        if p.zero == 3 and zero_shards(recipe, world_size) > 1:
            # ZeRO-3 computes with bf16 weights, which autocast saves as they are (freed with their unit), but
            # for the few it keeps fp32
            kv, head = _fp32_matmul_weights(recipe, pp_rank)
            weight_casts = 2 * (kv * len(rank_stages(recipe, pp_rank)[0]) + head) // p.virtual_stages
        else:  # 2 of 4 bytes; fp8's own linears' weights once a run in the cache's holders instead (rank_memory)
            cached = fp8_linear_elements(m, p.tp) * len(rank_stages(recipe, pp_rank)[0]) \
                if fp8_weights_once_a_run(recipe) else 0
            weight_casts = (model_state_bytes(recipe, world_size, pp_rank)[0] // 2 - 2 * cached) // p.virtual_stages
    rope = 0 if m.family == "gpt2" or p.recompute == "full" or rope_rows else FP32 * 2 * t.seq_len * m.head_dim
    # a sliding window without document masks: one (T, T) mask a block, kept by SDPA as a bias of q's dtype
    mask = t.seq_len ** 2 * (FP32 if t.precision == "fp32" else 2) if (m.sliding_window or t.seq_len) < t.seq_len \
        and p.cp == 1 and p.recompute == "none" and not recipe.data.document_mask else 0
    return rank_tokens(recipe, world_size) * block + rope + mask, weight_casts


def comm_bytes(recipe: Recipe, world_size: int, grad_bytes: int) -> int:
    """Transient communication buffers: gradient reduction buckets in flight (dp > 1; never more than the
    gradients they hold) and the p2p send and receive buffers of activations and gradients (pp > 1)."""
    p, m = recipe.parallel, recipe.model
    reduce_dp = _reduce_ranks(recipe, world_size)
    total = 0
    if reduce_dp > 1:
        buckets = min(MAX_IN_FLIGHT * DEFAULT_BUCKET_BYTES, grad_bytes)
        total += buckets + (buckets // reduce_dp if p.zero == 2 else 0)  # ZeRO 2: the reduce-scatter's output
    if p.pp > 1:
        tokens = rank_tokens(recipe, world_size) // (p.tp if p.sequence_parallel and p.tp > 1 else 1)
        total += 4 * FP32 * tokens * m.d_model  # send/recv x activation/gradient
    return total


def recompute_bytes(recipe: Recipe, world_size: int, pp_rank: int, kernels: bool = False) -> int:
    """Full recompute: the backward of a block first reruns its forward, so one block's activations of one
    microbatch (as saved without recompute) are live on top of the stored block inputs. kernels: triton_path."""
    p = recipe.parallel
    if p.recompute != "full" or not rank_stages(recipe, pp_rank)[0]:
        return 0
    kept = replace(recipe, parallel=replace(p, recompute="none"))
    return int(_layer_bytes(kept, world_size, pp_rank, kernels)[0])


def deferred_w_bytes(recipe: Recipe, world_size: int, pp_rank: int) -> int:
    """With the backward split (split_backward, and always for the V schedules), a chunk's input-gradient
    passes leave every linear's weight-gradient operands for its deferred W: the output gradients, which are
    no saved activation, and under full recompute the inputs too (otherwise saved activations already). One
    chunk's worth: W runs before the next chunk's backward would add more on most ranks."""
    p, m, t = recipe.parallel, recipe.model, recipe.train
    layers = rank_stages(recipe, pp_rank)[0]
    if not layers or p.pp == 1 or not (p.split_backward or placement_of(p.schedule) == "v"):
        return 0
    tokens = rank_tokens(recipe, world_size)
    inputs, grads = weight_grad_operand_bytes(m, p.tp, fp8=t.precision == "fp8")
    per_token = grads + (inputs if p.recompute == "full" else 0)
    return int(tokens * per_token * len(layers) / p.virtual_stages / (2 if t.precision == "bf16" else 1))


def weight_grad_operand_bytes(m: ModelConfig, tp: int, fp8: bool = False) -> tuple[float, float]:
    """(inputs, output gradients): bytes per token of one block's linears' weight-gradient operands with tp's
    shards: the inputs are the two norm outputs, the attention output and the MLP's hidden product; the
    output gradients those of q, k, v, the attention projection, gate and up (gpt2: fc) and the MLP output.
    A mixture of experts: its shared expert's (if any) as the MLP's (its router and experts compute dW in B).
    fp8: the fp8 linears (parallel/tensor/fp8.FP8_PLAN) compute dW in B too; a shared expert stays."""
    D, hidden = m.d_model, (m.shared_expert_intermediate_size if m.is_moe else 0 if fp8 else m.active_ffn) / tp
    q, kv = (0, 0) if fp8 else (m.n_heads * m.head_dim / tp, kv_rows(m, tp))
    mlp_inputs, mlp_grads = (0, 0) if not hidden else (D + hidden, (hidden if m.family == "gpt2" else 2 * hidden) + D)
    return FP32 * ((0 if fp8 else D + q) + mlp_inputs), FP32 * ((0 if fp8 else q + 2 * kv + D) + mlp_grads)


def _gather_bytes(recipe: Recipe, world_size: int, param_bytes: int, staged: bool) -> int:
    """ZeRO 1/2 all-gather the updated rows bucket by bucket, at most two in flight: each a full flat bucket
    and this rank's part. staged: the backend gathers into a flat copy of its own, then copies it into the
    output (gloo's all-gather into one tensor does; NCCL writes in place): one more bucket, measured on gloo as
    the gather's transient going from 39 to 63 MiB at 26 MiB of parameters per rank."""
    shards = zero_shards(recipe, world_size)
    if shards == 1:
        return 0
    buckets = min(MAX_IN_FLIGHT * DEFAULT_BUCKET_BYTES, param_bytes)
    staging = min(DEFAULT_BUCKET_BYTES, param_bytes) if staged else 0
    return buckets + buckets // shards + staging


def _grads_beside_activations(recipe: Recipe, world_size: int, grad_bytes: int, acts: int, in_flight: int) -> int:
    """Gradients live when the activations peak. Without pipelining, microbatches run one after the other,
    so from the second one on the full gradients sit beside one microbatch's activations. A pipeline's
    activations peak at the end of its warm-up, before the first backward; later peaks hold one unit fewer
    beside the gradients: max(acts, grads + acts (u - 1) / u) - acts."""
    p = recipe.parallel
    if p.pp == 1:
        return grad_bytes if busiest_microbatches(recipe, world_size) > 1 else 0
    return int(max(0.0, grad_bytes - acts / in_flight)) if in_flight else grad_bytes


def rank_memory(recipe: Recipe, world_size: int, in_flight: list[int] | None = None,
                staged_collectives: bool = False, device_type: str = "cpu") -> list[RankMemory]:
    """Every pp rank's predicted peak memory (dp rank 0, tp rank 0). staged_collectives: the backend copies
    collective outputs through buffers of its own (gloo, on CPU; DeviceProfile.staged_collectives).
    device_type ("cpu", "cuda"; DeviceProfile.device_type): what the run's ops keep (the Triton kernels on CUDA,
    plan/precision.py) and what train.fused_loss "auto" resolves to there."""
    given = in_flight  # a caller's bound (the search's quick 1F1B one), else the schedule's counts
    in_flight = in_flight or schedule_in_flight(recipe, world_size)
    fused, kernels = fused_loss_on(recipe, device_type), triton_path(device_type)
    out = []
    for r in range(recipe.parallel.pp):
        params, grads, optim = model_state_bytes(recipe, world_size, r)
        acts = activation_bytes(recipe, world_size, r, None if given is None else in_flight[r], fused, kernels)
        last = rank_stages(recipe, r)[2]
        tokens = rank_tokens(recipe, world_size)
        loss_temp = (fused_loss_bytes(recipe, tokens, device_type) if fused else
                     loss_backward_bytes(recipe, tokens, kernels)) if last else 0
        out.append(RankMemory(r, params, grads, optim, acts, comm_bytes(recipe, world_size, params),
                              step_temp=optim // MOMENTS,
                              recompute_temp=recompute_bytes(recipe, world_size, r, kernels),
                              deferred_w=deferred_w_bytes(recipe, world_size, r),
                              grads_live=_grads_beside_activations(recipe, world_size, params, acts, in_flight[r]),
                              full_grads=params,
                              gather=_gather_bytes(recipe, world_size, params, staged_collectives),
                              ps_tables=_ps_table_bytes(recipe, world_size, r),
                              loss_temp=loss_temp, weight_cache=_weight_cache_bytes(recipe, r, device_type),
                              **replica_bytes(recipe, world_size, params, optim // MOMENTS)))
    return out


def _weight_cache_bytes(recipe: Recipe, pp_rank: int, device_type: str) -> int:
    """fp8.Fp8WeightCache's holders on this pp rank (build_trainer makes one where fp8_weights_once_a_run): a float8
    copy of each fp8 linear's weight, and on the hardware (CUDA, not train.fp8_emulate) its column-major copy."""
    if not fp8_weights_once_a_run(recipe):
        return 0
    copies = 2 if device_type == "cuda" and not recipe.train.fp8_emulate else 1
    return copies * fp8_linear_elements(recipe.model, recipe.parallel.tp) * len(rank_stages(recipe, pp_rank)[0])


def run_memory(recipe: Recipe, world_size: int, staged_collectives: bool = False,
               device_type: str = "cpu") -> list[RankMemory]:
    """Every kind of rank's predicted peak: the workers' pp ranks (rank_memory), then each parameter server
    (server_memory). world_size: the mesh's ranks, servers excluded. The one estimate the pre-flight check,
    --dry-run and parallel.auto report."""
    return rank_memory(recipe, world_size, staged_collectives=staged_collectives, device_type=device_type) + \
        server_memory(recipe)


def _wrapped(recipe: Recipe, world_size: int) -> bool:
    """Whether a ReplicaOptimizer wraps the optimizer (needs_replica_sync on the layout's replica split)."""
    p = recipe.parallel
    dp = resolve_dp(recipe, world_size)
    shard = resolve_dp_shard(p, dp)
    return needs_replica_sync(p, SimpleNamespace(dp_replicate=dp // shard, dp_shard=shard), p.zero)


def _reduce_ranks(recipe: Recipe, world_size: int) -> int:
    """The ranks the bucketed gradient reduction spans: dp_shard when the replica wrapper exchanges across
    replicas itself, else all of dp, times cp (each cp rank holds the gradient of its own tokens)."""
    dp = resolve_dp(recipe, world_size)
    return (resolve_dp_shard(recipe.parallel, dp) if _wrapped(recipe, world_size) else dp) * recipe.parallel.cp


def replica_bytes(recipe: Recipe, world_size: int, param_bytes: int, row_bytes: int) -> dict:
    """What the cross-replica exchange (parallel/replicas/stale.py, periodic.py) holds, as RankMemory fields. The
    exchanged tensors are the rank's gradients and parameters, or under ZeRO its rows of them (row_bytes).
    Every wrapped mode's synchronous clocks (bsp, ssp's, local SGD's and DiLoCo's warm-up) sum gradients
    through one flat copy, alive while the update runs. ssp / dssp with staleness s: each clock launches an
    all-reduce of a new flat copy and applies those of clocks <= c - s, so s copies wait between steps and
    s + 1 exist during the update. local SGD: its average of the parameters goes through a flat copy.
    DiLoCo: the global parameters and the outer momentum (when outer_momentum > 0) for the whole run; the
    outer step holds the pseudo-gradient beside its averaged flat copy, then beside the Nesterov update."""
    p = recipe.parallel
    if not _wrapped(recipe, world_size):
        return {}
    exchanged = row_bytes if zero_shards(recipe, world_size) > 1 else param_bytes
    mode = sync_mode(p)
    out = {"exchange_temp": exchanged}
    if mode in ("ssp", "dssp"):
        out["pending"] = p.staleness * exchanged  # dssp: staleness is its upper bound
    elif mode == "local_sgd":
        out["sync_temp"] = exchanged
    elif mode == "diloco":
        out["replica_state"] = exchanged * (2 if p.outer_momentum > 0 else 1)
        out["sync_temp"] = 2 * exchanged
    return out


def _ps_table_bytes(recipe: Recipe, world_size: int, pp_rank: int) -> int:
    """A first-stage worker under parameter servers: the step's compact table of U rows (U at most the
    dp rank's tokens per step, and V), its gradient, and the next step's prefetched rows."""
    p, m, t = recipe.parallel, recipe.model, recipe.train
    if not p.ps_servers or not rank_stages(recipe, pp_rank)[1]:
        return 0
    unique = min(m.vocab_size, t.global_batch // resolve_dp(recipe, world_size) * t.seq_len)
    return 3 * FP32 * unique * m.d_model


def server_memory(recipe: Recipe) -> list[RankMemory]:
    """Each parameter server's peak (parallel/ps/server.py): its rows of the V x d table (row_range; never
    the whole table), their two AdamW moments, the dense gradient of its rows (one update at a time) with
    AdamW's temporaries, and the transient beside that gradient: under bsp the squared norm reads it as an
    fp64 copy and squares that (4 rows' worth of fp32 bytes), under async a push is scaled into a copy."""
    p, m = recipe.parallel, recipe.model
    out = []
    for index in range(p.ps_servers):
        lo, hi = row_range(m.vocab_size, p.ps_servers, index)
        rows = FP32 * (hi - lo) * m.d_model
        norm = {"bsp": 4 * rows, "async": rows}.get(p.ps_sync, 0)
        out.append(RankMemory(index, rows, rows, MOMENTS * rows, 0, 0, step_temp=rows, full_grads=rows,
                              sync_temp=norm, role="server"))
    return out
