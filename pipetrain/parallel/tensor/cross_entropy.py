"""Vocab-parallel cross-entropy: the loss of logits sharded by vocabulary over tp, never gathered.

Each tp rank holds the logits of the vocabulary ids [tp_rank * V/tp, (tp_rank + 1) * V/tp) (the head's
weight rows it owns). The row max, the sum of exponentials and the target logit are combined over
tp_group (pipetrain.parallel.mesh.comm), so the loss and the gradient of each shard equal the unsharded
ones. The local math is pipetrain.kernels.cross_entropy's: on the Triton path its CrossEntropyFn with
the combine below; on the torch path the reference here, whose sums go through reduce_from_tp
(forward all-reduce, backward identity: the loss is replicated on every tp rank and each rank
back-propagates it once, so the gradient reaching a rank's summand is that of the one shared loss).

The fused head + loss (train.fused_loss): vocab_parallel_linear_cross_entropy runs
pipetrain.kernels.linear_cross_entropy on this rank's (V/tp, D) rows of the head with the same combine
per chunk of tokens, so no rank ever holds more than a (C, V/tp) block of logits. Its dhidden is this
shard's part; the head's tp region (head_cross_entropy enters it as the head's forward would) sums the
parts in its backward.

Shapes: logits (..., V/tp) flattened to (N, V/tp), targets (...,) -> (N,), per-row numbers (N,), loss ();
hidden (..., D), head weight (V/tp, D).
"""
from __future__ import annotations

import functools

import torch

from pipetrain.kernels.cross_entropy import CrossEntropyFn, as_fp32_rows, check_targets, cross_entropy
from pipetrain.kernels.dispatch import use_triton
from pipetrain.kernels.linear_cross_entropy import linear_cross_entropy
from pipetrain.parallel.mesh.comm import ProcessGroup, all_reduce_, all_reduce_max_, group_rank, group_size, reduce_from_tp
from pipetrain.parallel.tensor.layers import ColumnParallelLinear


def vocab_parallel_cross_entropy_ref(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                                     tp_group: ProcessGroup = None) -> torch.Tensor:
    """The torch path and test oracle: the mean loss of the unsharded logits from torch ops and
    reductions over tp_group (also for a group of one, so gradcheck can run it)."""
    x, t = as_fp32_rows(logits), targets.reshape(-1)  # (N, V/tp), (N,)
    v_local = x.shape[-1]
    vocab_start = group_rank(tp_group) * v_local
    # The max only keeps exp() in range: lse = m + log(sum exp(x - m)) for any m, so its gradient
    # through m is zero and it is detached (a MAX all-reduce has no useful derivative anyway).
    row_max = all_reduce_max_(x.detach().amax(dim=-1), tp_group)
    sum_exp = reduce_from_tp((x - row_max[:, None]).exp().sum(-1), tp_group)  # (N,)
    local_t = t - vocab_start
    in_shard = (local_t >= 0) & (local_t < v_local) & (t != ignore_index)
    target_logit = x.gather(1, local_t.clamp(0, v_local - 1)[:, None]).squeeze(1)
    target_logit = reduce_from_tp(torch.where(in_shard, target_logit, 0.0), tp_group)  # (N,)
    valid = t != ignore_index
    loss_rows = row_max + sum_exp.log() - target_logit
    return torch.where(valid, loss_rows, 0.0).sum() / valid.sum()


def _combine_rows(tp_group: ProcessGroup, row_max: torch.Tensor, sum_exp: torch.Tensor, target_logit: torch.Tensor):
    """The Triton forward's per-row (max, sum of exp(x - max), target logit) of this shard -> the same
    over the whole vocabulary: a MAX all-reduce, then one SUM all-reduce for both sums."""
    global_max = all_reduce_max_(row_max.clone(), tp_group)
    sums = all_reduce_(torch.stack((sum_exp * torch.exp(row_max - global_max), target_logit)), tp_group)  # (2, N)
    return global_max, sums[0], sums[1]


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                                 tp_group: ProcessGroup = None) -> torch.Tensor:
    """Mean cross-entropy of vocab-sharded logits (..., V/tp) against targets (...), the same on every tp
    rank; pipetrain.kernels.cross_entropy when tp_group is a group of one (or None)."""
    if group_size(tp_group) == 1:
        return cross_entropy(logits, targets, ignore_index)
    check_targets(logits, targets)
    if use_triton(logits):
        vocab_start = group_rank(tp_group) * logits.shape[-1]
        return CrossEntropyFn.apply(logits, targets, ignore_index, vocab_start,
                                    functools.partial(_combine_rows, tp_group))
    return vocab_parallel_cross_entropy_ref(logits, targets, ignore_index, tp_group)


def vocab_parallel_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                        ignore_index: int = -100, tp_group: ProcessGroup = None) -> torch.Tensor:
    """Mean cross-entropy of hidden @ weight.T where weight holds this tp rank's vocabulary rows
    (V/tp, D), the same on every tp rank; hidden must already be in the tp region (head_cross_entropy)."""
    if group_size(tp_group) == 1:
        return linear_cross_entropy(hidden, weight, targets, ignore_index)
    return linear_cross_entropy(hidden, weight, targets, ignore_index, vocab_start=group_rank(tp_group) * weight.shape[0],
                                combine=functools.partial(_combine_rows, tp_group))


def head_cross_entropy(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, ignore_index: int = -100,
                       tp_group: ProcessGroup = None) -> torch.Tensor:
    """The mean loss of head(hidden) against targets with the head fused into the loss: hidden (B, T, D)
    (or (B, T/tp, D) under sequence parallelism) enters the head's tp region, then the fused op runs on
    the head's weight (a tied embedding's weight too: its gradient reaches the shared parameter)."""
    if getattr(head, "bias", None) is not None:
        raise ValueError("train.fused_loss: the LM head has a bias, which the fused loss does not add; "
                         "set train.fused_loss=false")
    if isinstance(head, ColumnParallelLinear):
        hidden = head.enter(hidden)
    return vocab_parallel_linear_cross_entropy(hidden, head.weight, targets, ignore_index, tp_group)
