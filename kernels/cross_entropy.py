"""Cross-entropy over the last dim, mean over targets != ignore_index, returned as an fp32 scalar.
All-ignored input gives NaN (0/0), as F.cross_entropy does.

Triton path: a forward kernel makes one pass over each row (online max and sum-exp) and writes three
fp32 numbers per row; torch turns them into the row's log-sum-exp. The backward kernel recomputes softmax(x) - onehot from the saved logits and that
log-sum-exp, so nothing of size (N, V) but the logits themselves is kept between forward and backward.
The gradient goes into a fresh buffer in the logits dtype rather than over the logits: the kernels
write through raw pointers, invisible to autograd's version counter, so overwriting a tensor that
another op saved (a soft-capping tanh, a user's copy of the logits) would corrupt it silently.

Vocabulary shards: CrossEntropyFn also takes logits that hold only the columns [vocab_start,
vocab_start + V_local) of the vocabulary, with a `combine` function that merges the three per-row
numbers over all shards; pipetrain.parallel.tensor.cross_entropy builds the vocab-parallel loss from it
(kernels know nothing of processes).

Shapes: logits (..., V) or a shard (..., V_local) flattened to (N, V_local), targets (...,) -> (N,), loss ().
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import HAS_TRITON, check_dtype, triton, tl, use_triton
from .triton_helpers import num_warps_for

if HAS_TRITON:
    from .triton_helpers import round_to  # a triton.jit function: defined only with triton

# Vocabulary columns per loop iteration. 4096 fp32 values (16 KB) is a quarter of the 64 KB
# per-program budget (triton_helpers.MAX_FUSED_BYTES), leaving registers for the exp temporaries;
# not tuned on a GPU (none here). Any V works: the kernels loop over blocks.
_MAX_BLOCK = 4096


def as_fp32_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits (..., V) as (N, V) in fp32 math (float64 stays float64, so gradcheck can run on a reference)."""
    return logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32))


def cross_entropy_ref(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The spec (CPU path and test oracle): fp32 cross-entropy, mean over non-ignored targets."""
    return F.cross_entropy(as_fp32_rows(logits), targets.reshape(-1), ignore_index=ignore_index)


if HAS_TRITON:
    @triton.jit
    def row_max_sum_exp(x_ptr, base, V, BLOCK: tl.constexpr):
        """One pass over a row of V logits at x_ptr + base: the online max and sum of exp(x - max), fp32."""
        row_max = tl.full((), float("-inf"), tl.float32)
        sum_exp = tl.full((), 0.0, tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(row_max, tl.max(x, axis=0))
            sum_exp = sum_exp * tl.exp(row_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            row_max = new_max
        return row_max, sum_exp

    @triton.jit
    def store_grad_row(x_ptr, dx_ptr, base, V, lse, local_t, scale, BLOCK: tl.constexpr):
        """dx = (exp(x - lse) - onehot(local_t)) * scale over one row, rounded to dx's dtype. dx_ptr may
        be x_ptr: each element is read before it is written, by the same program."""
        dt = dx_ptr.dtype.element_ty
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < V
            x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
            g = (tl.exp(x - lse) - tl.where(cols == local_t, 1.0, 0.0)) * scale
            tl.store(dx_ptr + base + cols, round_to(g, dt).to(dt), mask=mask)

    @triton.jit
    def _cross_entropy_fwd_kernel(x_ptr, t_ptr, max_ptr, sum_exp_ptr, target_logit_ptr, V, vocab_start,
                                  ignore_index, BLOCK: tl.constexpr):
        # One program per row: online max and sum of exp(x - max) over blocks of V, plus the target's
        # logit when the target falls in this shard [vocab_start, vocab_start + V) (else 0).
        row = tl.program_id(0)
        base = row.to(tl.int64) * V  # int64: N * V passes 2**31 for real vocabularies
        row_max, sum_exp = row_max_sum_exp(x_ptr, base, V, BLOCK)
        t = tl.load(t_ptr + row)
        local_t = t - vocab_start
        hit = (t != ignore_index) & (local_t >= 0) & (local_t < V)
        target_logit = tl.load(x_ptr + base + local_t, mask=hit, other=0.0).to(tl.float32)
        tl.store(max_ptr + row, row_max)
        tl.store(sum_exp_ptr + row, sum_exp)
        tl.store(target_logit_ptr + row, target_logit)

    @triton.jit
    def _cross_entropy_bwd_kernel(x_ptr, t_ptr, lse_ptr, scale_ptr, dx_ptr, V, vocab_start, ignore_index,
                                  BLOCK: tl.constexpr):
        # dx = (softmax(x) - onehot(t)) * scale, scale = dloss / n_valid (0 for ignored rows); in place
        # when dx_ptr is x_ptr (store_grad_row).
        row = tl.program_id(0)
        base = row.to(tl.int64) * V
        t = tl.load(t_ptr + row)
        lse = tl.load(lse_ptr + row)
        scale = tl.where(t == ignore_index, 0.0, tl.load(scale_ptr))
        store_grad_row(x_ptr, dx_ptr, base, V, lse, t - vocab_start, scale, BLOCK)


def _block(V: int) -> int:
    return min(triton.next_power_of_2(V), _MAX_BLOCK)


def _flatten(logits: torch.Tensor, targets: torch.Tensor):
    check_dtype("cross_entropy logits", logits)
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"cross_entropy: targets dtype {targets.dtype} must be int64 or int32")
    V = logits.shape[-1]
    if V == 0:
        raise ValueError("cross_entropy: logits have an empty last dim")
    return logits.reshape(-1, V).contiguous(), targets.reshape(-1).contiguous()  # (N, V_local), (N,)


def cross_entropy_fwd(x2: torch.Tensor, t: torch.Tensor, ignore_index: int, vocab_start: int = 0):
    """Launcher: x2 (N, V) contiguous, t (N,) -> per-row fp32 (max, sum of exp(x - max), target logit)."""
    N, V = x2.shape
    row_max, sum_exp, target_logit = (torch.empty(N, device=x2.device, dtype=torch.float32) for _ in range(3))
    if N:
        block = _block(V)
        _cross_entropy_fwd_kernel[(N,)](x2, t, row_max, sum_exp, target_logit, V, vocab_start, ignore_index,
                                        BLOCK=block, num_warps=num_warps_for(block))
    return row_max, sum_exp, target_logit


def cross_entropy_bwd(x2: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
                      ignore_index: int, vocab_start: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launcher: (softmax(x2) - onehot(t)) * scale into out (a new buffer, or x2 itself for in place)."""
    N, V = x2.shape
    out = torch.empty_like(x2) if out is None else out
    if N:
        block = _block(V)
        _cross_entropy_bwd_kernel[(N,)](x2, t, lse, scale, out, V, vocab_start, ignore_index, BLOCK=block,
                                        num_warps=num_warps_for(block))
    return out


class CrossEntropyFn(torch.autograd.Function):
    """Mean cross-entropy on the Triton kernels. For a vocabulary shard (columns from vocab_start),
    combine(row_max, sum_exp, target_logit) returns the three per-row numbers over the whole
    vocabulary (None: the logits hold all of it); the loss is then the full one, and the backward
    yields this shard's gradient with no further combining."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index, vocab_start, combine):
        x2, t = _flatten(logits, targets)
        row_max, sum_exp, target_logit = cross_entropy_fwd(x2, t, ignore_index, vocab_start)
        if combine is not None:
            row_max, sum_exp, target_logit = combine(row_max, sum_exp, target_logit)
        lse = row_max + torch.log(sum_exp)  # (N,)
        valid = t != ignore_index
        n_valid = valid.sum()
        loss = torch.where(valid, lse - target_logit, 0.0).sum() / n_valid
        ctx.save_for_backward(x2, t, lse, n_valid)
        ctx.ignore_index, ctx.vocab_start, ctx.shape = ignore_index, vocab_start, logits.shape
        return loss

    @staticmethod
    def backward(ctx, dloss):
        x2, t, lse, n_valid = ctx.saved_tensors
        scale = (dloss.float() / n_valid).reshape(1)  # a device tensor: no host sync for the scale
        dx = cross_entropy_bwd(x2, t, lse, scale, ctx.ignore_index, ctx.vocab_start)
        return dx.view(ctx.shape), None, None, None, None


def check_targets(logits: torch.Tensor, targets: torch.Tensor) -> None:
    """Raise ValueError unless targets has the shape of logits without its last dim."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"cross_entropy: logits {tuple(logits.shape)} and targets {tuple(targets.shape)} "
                         "must agree on all but the last dim")


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of logits (..., V) against targets (...)."""
    check_targets(logits, targets)
    if use_triton(logits):
        return CrossEntropyFn.apply(logits, targets, ignore_index, 0, None)
    return cross_entropy_ref(logits, targets, ignore_index)
