"""Attention over the whole sequence when each cp rank holds a slice of it: all-gather K and V, keep Q local.

Why all-gather rather than ring passing (Megatron's and torchtitan's all-gather mode): it is one collective
per tensor with no online-softmax merge to get right; the head/tail slicing (slicing.py) already balances the
causal work exactly, which is what a ring's zig-zag schedule is for; and K/V are the small tensors under GQA
(Hkv heads, not Hq), so gathering them costs (cp-1)/cp of 2*Hkv*K values per token and layer. The price is
that each rank holds the full-length K and V of the layer it runs (B, T, Hkv, K), which a ring would avoid.

The mask is built for this rank's (T/cp queries x T keys) block only, from global positions: query i may see
key j when j <= i (causal), j >= i - pos_i (the same document: pos_i is i's position inside its document,
which the loader restarts at 0 at each document start) and i - j < window (sliding window). With no document
mask (data.document_mask off) the mask is the same for every sequence, so it is built once as (1, 1, T/cp, T)
from the indices alone; with document masks it is (B, 1, T/cp, T). SDPA keeps a float copy of the mask for
backward (and the math backend its (B, Hq, T/cp, T) scores): at most T/cp x T per sequence and head, never
T x T.

The model stays blind: apply_context_parallel swaps each Attention's `core` (the parameter-free module
selective recompute wraps) and sets its `rope_len`, as tensor parallelism swaps modules from a name table.

Shapes: B batch, T sequence, T/cp this rank's slice, Hq / Hkv query / key-value heads, K head dim.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipetrain.models.decoder import Attention, AttentionCore
from pipetrain.parallel.context.slicing import chunk_index, gathered_index
from pipetrain.parallel.mesh.comm import gather_over_cp


def context_mask(query_index: torch.Tensor, key_index: torch.Tensor, positions: torch.Tensor,
                 sliding_window: int | None) -> torch.Tensor:
    """(B, 1, T/cp, T) bool, True where a local query may attend a key; query_index (T/cp,) and key_index
    (T,) are global positions in the sequence, positions (B, T/cp) each query's position in its document."""
    qi, kj = query_index[None, :, None], key_index[None, None, :]
    start = (query_index[None, :] - positions)[:, :, None]  # (B, T/cp, 1) first key of the query's document
    allowed = (kj <= qi) & (kj >= start)
    if sliding_window:
        allowed = allowed & (qi - kj < sliding_window)
    return allowed[:, None]


class ContextParallelCore(AttentionCore):
    """AttentionCore on a cp slice: local queries against every key and value of the sequence.
    A subclass so code that finds attention cores by type (recompute) still finds it."""

    def __init__(self, sliding_window: int | None, cp_group, cp: int, cp_rank: int, document_mask: bool):
        super().__init__(sliding_window)
        self.cp_group, self.cp, self.cp_rank = cp_group, cp, cp_rank
        self.document_mask = document_mask  # False: positions are the global ones, the mask is batch-free

    def forward(self, q, k, v, positions=None):  # q (B, T/cp, Hq, K), k/v (B, T/cp, Hkv, K) -> (B, T/cp, Hq*K)
        assert positions is not None, "context parallelism needs each token's position: the loader's " \
            "SequenceSlicer supplies them (pipetrain.parallel.context.slicing)"
        k = gather_over_cp(k.contiguous(), self.cp_group)  # (B, T, Hkv, K); backward reduce-scatters dK
        v = gather_over_cp(v.contiguous(), self.cp_group)
        T = q.shape[1] * self.cp
        queries = chunk_index(T, self.cp, self.cp_rank, q.device)
        mask = context_mask(queries, gathered_index(T, self.cp, q.device),
                            positions if self.document_mask else queries[None], self.sliding_window)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2).flatten(2)


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
    return names
