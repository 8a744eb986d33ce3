"""Attention over the whole sequence when each cp rank holds a slice of it: all-gather K and V, keep Q local.

Why all-gather rather than ring passing (Megatron's and torchtitan's all-gather mode): it is one collective
per tensor with no online-softmax merge to get right; the head/tail slicing (slicing.py) already balances the
causal work exactly, which is what a ring's zig-zag schedule is for; and K/V are the small tensors under GQA
(Hkv heads, not Hq), so gathering them costs (cp-1)/cp of 2*Hkv*K values per token and layer. The price is
that each rank holds the full-length K and V of the layer it runs (B, T, Hkv, K), which a ring would avoid.

The mask is built for this rank's (T/cp queries x T keys) block only, from global positions: query i may see
key j when j <= i (causal), j >= i - pos_i (the same document: pos_i is i's position inside its document,
which the loader restarts at 0 at each document start) and i - j < window (sliding window). With no document
mask (data.document_mask off) the mask is the same for every sequence, so it is built as (1, 1, c, L) from the
indices alone; with document masks it is (B, 1, c, L), for a query chunk of c = T/(2cp) tokens and the L <= T
keys up to its end. The mask and the attention of one chunk are transient (checkpointed, see below): the peak
is one (B, 1, c, L) mask and SDPA's working set for it, at most T/(2cp) x T per sequence; never T x T.

The model stays blind: apply_context_parallel swaps each Attention's `core` (the parameter-free module
selective recompute wraps) and sets its `rope_len`, as tensor parallelism swaps modules from a name table, and
gives each mixture-of-experts layer a TokenSplit: its per-sequence balance loss sums expert counts over cp.

Shapes: B batch, T sequence, T/cp this rank's slice, Hq / Hkv query / key-value heads, K head dim.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from pipetrain.models.decoder import Attention, AttentionCore
from pipetrain.models.moe import moe_layers
from pipetrain.parallel.context.slicing import gathered_index
from pipetrain.parallel.mesh.comm import all_reduce_, gather_over_cp


def context_mask(query_index: torch.Tensor, key_index: torch.Tensor, positions: torch.Tensor,
                 sliding_window: int | None) -> torch.Tensor:
    """(B, 1, Q, L) bool, True where a query may attend a key; query_index (Q,) and key_index (L,) are global
    positions in the sequence, positions (B, Q) (or (1, Q)) each query's position in its document."""
    qi, kj = query_index[None, :, None], key_index[None, None, :]
    start = (query_index[None, :] - positions)[:, :, None]  # (B, Q, 1) first key of the query's document
    allowed = (kj <= qi) & (kj >= start)
    if sliding_window:
        allowed = allowed & (qi - kj < sliding_window)
    return allowed[:, None]


def _attend(q, k, v, positions, q_start: int, k_start: int, sliding_window: int | None):
    """One query chunk against a contiguous run of keys in sequence order: q (B, c, Hq, K) holds positions
    q_start.., k/v (B, L, Hkv, K) positions k_start..; positions (B, c) in-document, or None (global)."""
    query_index = torch.arange(q_start, q_start + q.shape[1], device=q.device)
    key_index = torch.arange(k_start, k_start + k.shape[1], device=q.device)
    mask = context_mask(query_index, key_index, query_index[None] if positions is None else positions, sliding_window)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


class ContextParallelCore(AttentionCore):
    """AttentionCore on a cp slice: local queries against every key and value of the sequence.
    A subclass so code that finds attention cores by type (recompute) still finds it.

    The gathered K/V are put back in sequence order, and each of the two query chunks (head, tail) attends
    only the keys up to its own end (and, under a sliding window, from the first key its first query can
    see): the fully masked blocks after the chunk are never computed, so each rank does ~1/cp of the
    single-process attention work. Each chunk's mask and attention run under activation checkpointing
    (torch.utils.checkpoint): backward keeps q, K, V, not the mask SDPA would save, and recomputes one
    chunk's attention at a time."""

    def __init__(self, sliding_window: int | None, cp_group, cp: int, cp_rank: int, document_mask: bool):
        super().__init__(sliding_window)
        self.cp_group, self.cp, self.cp_rank = cp_group, cp, cp_rank
        self.document_mask = document_mask  # False: positions are the global ones, the mask is batch-free

    def forward(self, q, k, v, positions=None):  # q (B, T/cp, Hq, K), k/v (B, T/cp, Hkv, K) -> (B, T/cp, Hq*K)
        assert positions is not None, "context parallelism needs each token's position: the loader's " \
            "SequenceSlicer supplies them (pipetrain.parallel.context.slicing)"
        k = gather_over_cp(k.contiguous(), self.cp_group)  # (B, T, Hkv, K) in cp rank order; backward
        v = gather_over_cp(v.contiguous(), self.cp_group)  # reduce-scatters dK / dV
        c = q.shape[1] // 2
        T = 2 * c * self.cp
        order = torch.argsort(gathered_index(T, self.cp, q.device))  # sequence position -> gathered row
        k, v = k[:, order], v[:, order]  # (B, T, Hkv, K) in sequence order
        outs = []
        for half, chunk in ((0, self.cp_rank), (1, 2 * self.cp - 1 - self.cp_rank)):
            q_start, end = chunk * c, (chunk + 1) * c
            begin = max(0, q_start - self.sliding_window + 1) if self.sliding_window else 0
            pos = positions[:, half * c:(half + 1) * c] if self.document_mask else None
            outs.append(checkpoint(_attend, q[:, half * c:(half + 1) * c], k[:, begin:end], v[:, begin:end], pos,
                                   q_start, begin, self.sliding_window, use_reentrant=False))
        return torch.cat(outs, dim=1).flatten(2)


class TokenSplit:
    """A MoE layer's view of cp (pipetrain.models.moe, balance loss): parts ranks hold a sequence's tokens;
    sum(t) sums a tensor of per-sequence counts over them, in place (no gradient: counts are integers)."""

    def __init__(self, cp_group, cp: int):
        self.group, self.parts = cp_group, cp

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_(t, self.group)


def apply_context_parallel(model: nn.Module, dims, seq_len: int, document_mask: bool) -> list[str]:
    """Swap every Attention's core for the cp one and index RoPE by global positions up to seq_len, in
    place; returns the swapped module names. document_mask: data.document_mask (positions restart inside
    a sequence). A no-op when dims.cp == 1. Run it before apply_recompute, which wraps the cores."""
    if dims.cp == 1:
        return []
    assert dims.cp_group is not None, f"{dims.coords} cp={dims.cp} but dims has no cp_group; build it with " \
        "ParallelDims.init under torch.distributed"
    names = []
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            module.core = ContextParallelCore(module.core.sliding_window, dims.cp_group, dims.cp, dims.cp_rank,
                                              document_mask)
            module.rope_len = seq_len
            names.append(f"{name}.core")
    for moe in moe_layers(model).values():
        moe.token_split = TokenSplit(dims.cp_group, dims.cp)
    return names
