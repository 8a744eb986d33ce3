"""Which tokens of every sequence a cp rank holds: the head/tail split that balances causal attention.

A sequence of T tokens is cut into 2*cp equal chunks; cp rank r keeps chunk r and chunk 2cp-1-r, in that
order. Under a causal mask a query's work grows with its position, so pairing an early chunk with a late one
gives every rank the same number of (query, key) pairs: exact balance, with no ring schedule to arrange it.

Shapes: B batch, T the full sequence, T/cp this rank's slice.
"""
from __future__ import annotations

from dataclasses import replace

import torch


def chunk_index(seq_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """(T/cp,) int64: the global positions of cp rank cp_rank's tokens, head chunk then tail chunk."""
    assert seq_len % (2 * cp) == 0 and 0 <= cp_rank < cp, \
        f"seq_len={seq_len} must split into 2*cp={2 * cp} chunks (rules.context_problems checks the recipe)"
    c = seq_len // (2 * cp)
    head = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    tail = torch.arange((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c, device=device)
    return torch.cat([head, tail])


def gathered_index(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """(T,) int64: the global position of every key after an all-gather over cp (rank order)."""
    return torch.cat([chunk_index(seq_len, cp, r, device) for r in range(cp)])


def slice_batch(batch, cp: int, cp_rank: int):
    """This cp rank's slice of a data.Batch (inputs, targets, positions along T): the same dataclass, with
    positions always set, since the model cannot infer a slice's positions from its length. Without a
    document mask the positions are the global ones 0..T-1 (sliced); with it, the positions inside each
    document, which the attention mask and RoPE both read."""
    T = batch.inputs.shape[1]
    index = chunk_index(T, cp, cp_rank)
    positions = batch.positions
    if positions is None:
        positions = torch.arange(T).expand(batch.inputs.shape[0], T)
    return replace(batch, inputs=batch.inputs[:, index], targets=batch.targets[:, index],
                   positions=positions[:, index].contiguous())


class SequenceSlicer:
    """The callable a Loader applies to each batch it serves (Loader.sequence_slice): this cp rank's slice."""

    def __init__(self, cp: int, cp_rank: int):
        self.cp, self.cp_rank = cp, cp_rank

    def __call__(self, batch):
        return slice_batch(batch, self.cp, self.cp_rank)
