"""Cross-entropy over the last dim, mean over targets != ignore_index, returned as an fp32 scalar.

Vocab-parallel mode (tp_group given): each tp rank holds the logits of vocabulary rows
[tp_rank * V/tp, (tp_rank + 1) * V/tp); the row max, the sum of exponentials and the target logit are
all-reduced over tp_group, so the loss and the gradient of each shard equal the unsharded ones without
ever gathering the logits. All-ignored input gives NaN (0/0), as F.cross_entropy does.

Shapes: logits (..., V) or (..., V/tp) flattened to (N, V/tp), targets (...,) -> (N,), loss ().
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class _AllReduceSumFn(torch.autograd.Function):
    """forward: all-reduce sum over tp_group; backward: identity.

    The loss is replicated on every tp rank and each rank back-propagates it once, so the gradient
    reaching a rank's summand is the gradient of the one shared loss: no reduction in backward."""

    @staticmethod
    def forward(ctx, x, tp_group):
        import torch.distributed as dist  # lazy: see cross_entropy(); kernels never import it at load time
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=tp_group)
        return x

    @staticmethod
    def backward(ctx, dy):
        return dy, None


def _vocab_parallel_ref(x, t, ignore_index, tp_group):
    """x (N, V/tp) fp32 or float64, t (N,): the mean loss of the unsharded logits, from torch ops + all-reduces."""
    import torch.distributed as dist  # lazy: see cross_entropy()
    v_local = x.shape[-1]
    vocab_start = dist.get_rank(tp_group) * v_local
    # The max only keeps exp() in range: lse = m + log(sum exp(x - m)) for any m, so its gradient
    # through m is zero and it is detached (a MAX all-reduce has no useful derivative anyway).
    row_max = x.detach().amax(dim=-1)
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
    sum_exp = _AllReduceSumFn.apply((x - row_max[:, None]).exp().sum(-1), tp_group)  # (N,)
    local_t = t - vocab_start
    in_shard = (local_t >= 0) & (local_t < v_local) & (t != ignore_index)
    target_logit = x.gather(1, local_t.clamp(0, v_local - 1)[:, None]).squeeze(1)
    target_logit = _AllReduceSumFn.apply(torch.where(in_shard, target_logit, 0.0), tp_group)  # (N,)
    valid = t != ignore_index
    loss_rows = row_max + sum_exp.log() - target_logit
    return torch.where(valid, loss_rows, 0.0).sum() / valid.sum()


def cross_entropy_ref(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                      tp_group=None) -> torch.Tensor:
    """The spec (CPU path and test oracle): fp32 cross-entropy, mean over non-ignored targets."""
    # fp32 math (float64 stays float64, so gradcheck can run on the reference)
    x = logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32))  # (N, V/tp)
    t = targets.reshape(-1)
    if tp_group is None:
        return F.cross_entropy(x, t, ignore_index=ignore_index)
    return _vocab_parallel_ref(x, t, ignore_index, tp_group)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                  tp_group=None) -> torch.Tensor:
    """Mean cross-entropy of logits (..., V) against targets (...); vocab-parallel when tp_group is given.

    tp_group is a torch.distributed process group. This fixed signature is the documented exception to
    "kernels never import torch.distributed": it is imported lazily, only when tp_group is passed, so
    importing pipetrain.kernels stays free of it."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"cross_entropy: logits {tuple(logits.shape)} and targets {tuple(targets.shape)} "
                         "must agree on all but the last dim")
    return cross_entropy_ref(logits, targets, ignore_index, tp_group)
