"""LM head + cross-entropy fused over chunks of tokens so the (N, V) logits never exist at once.

loss = mean over targets != ignore_index of cross_entropy(hidden @ weight.T, targets). The forward
walks the tokens in chunks of C rows: logits_c = h_c @ W.T (C, V), then the scaled gradient
g_c = (softmax - onehot) / n_valid (in place on the Triton path, from one log_softmax on the CPU
path), then dh_c = g_c @ W into an (N, D) buffer and dW += g_c.T @ h_c.
The backward only multiplies the stored dh and dW by the incoming scalar gradient, out of place: the
op stays reentrant (retain_graph, gradcheck) and autograd takes the fresh product as .grad without a
copy, at the price of holding the stored dW and its scaled copy together for that moment. The idea is
Liger-Kernel's fused linear cross-entropy; this is an independent implementation.

Chunk size: C = max(ceil(N * D / V), MIN_CHUNK_ROWS) rows (at most N), so a chunk's logits hold about
as many elements as the hidden states (N, D) themselves; peak extra memory is then ~ 2 (C, V) chunks +
(N, D) dh + (V, D) dW instead of the (N, V) logits plus their fp32 softmax and gradient. bf16 dW
accumulates in fp32 (rounded to bf16 at the end) so summing chunk products does not lose bits; that
costs (V, D) fp32 during the forward.

Both dispatch paths are chunked (so CPU runs get the memory saving); they differ in the per-chunk
softmax: the Triton path runs cross_entropy's kernels in place on the chunk, the CPU path torch ops.
linear_cross_entropy_ref is the unfused spec, the test oracle only.

Returns an fp32 scalar (float64 for float64 inputs, which only the torch path takes).
Shapes: hidden (N, D) (or (..., D), flattened), weight (V, D), targets (N,), chunk logits (C, V).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .cross_entropy import cross_entropy_bwd, cross_entropy_fwd
from .dispatch import check_dtype, use_triton


def linear_cross_entropy_ref(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                             ignore_index: int = -100) -> torch.Tensor:
    """The unfused spec (test oracle): the full (N, V) logits, then fp32 cross-entropy."""
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()  # (N, V)
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), targets.reshape(-1),
                           ignore_index=ignore_index)


# Floor on the chunk: every chunk's dW update reads and writes the whole (V, D) accumulator, ~8*V*D
# bytes for ~6*C*V*D flops of matmul, so with few rows per chunk the loop is bandwidth-bound (C = 4
# at N=1024, D=512, V=128k made the CPU benchmark several times slower). A few hundred rows keep a GPU
# compute-bound (flops/byte of an A100/H100 is ~100-300); 256 rows of logits are small next to dW.
MIN_CHUNK_ROWS = 256


def chunk_rows(N: int, D: int, V: int) -> int:
    """Tokens per chunk: (C, V) logits about the size of the (N, D) hidden states, at least MIN_CHUNK_ROWS."""
    return max(1, min(N, max(-(-N * D // V), MIN_CHUNK_ROWS)))


def _chunk_torch(logits, t, ignore_index, inv_n_valid):
    """CPU path of one chunk: fp32 loss sum and the (C, V) gradient (softmax - onehot) * inv_n_valid.

    log_softmax is one fused pass in torch; building it from logsumexp and in-place ops measured ~3x
    slower on this CPU. Its output becomes the gradient in place."""
    lsm = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # (C, V)
    valid = t != ignore_index
    safe_t = torch.where(valid, t, 0)[:, None]
    loss_sum = -torch.where(valid, lsm.gather(1, safe_t).squeeze(1), 0.0).sum()
    grad = lsm.exp_()
    grad.scatter_add_(1, safe_t, -valid.to(grad.dtype)[:, None])
    grad.mul_(torch.where(valid, inv_n_valid, 0.0)[:, None])
    return loss_sum, grad.to(logits.dtype)


def _chunk_triton(logits, t, ignore_index, inv_n_valid):
    """Triton path of one chunk: cross_entropy's kernels, the backward one in place over the logits."""
    row_max, sum_exp, target_logit = cross_entropy_fwd(logits, t, ignore_index)
    lse = row_max + torch.log(sum_exp)
    loss_sum = torch.where(t != ignore_index, lse - target_logit, 0.0).sum()
    return loss_sum, cross_entropy_bwd(logits, t, lse, inv_n_valid.reshape(1), ignore_index, out=logits)


class LinearCrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, use_kernels, need_dh, need_dw):
        D = hidden.shape[-1]
        h2 = hidden.reshape(-1, D).contiguous()  # (N, D)
        t = targets.reshape(-1).contiguous()  # (N,)
        N, V = h2.shape[0], weight.shape[0]
        valid = t != ignore_index
        n_valid = valid.sum()
        acc_dtype = torch.promote_types(h2.dtype, torch.float32)  # fp32, or float64 for gradcheck
        inv_n_valid = 1.0 / n_valid.to(acc_dtype)  # a device scalar: no host sync
        dh = torch.empty_like(h2) if need_dh else None
        dw = torch.zeros(V, D, device=weight.device, dtype=acc_dtype) if need_dw else None  # fp32 accumulator
        loss_sum = torch.zeros((), device=h2.device, dtype=acc_dtype)
        chunk_fn = _chunk_triton if use_kernels else _chunk_torch
        C = chunk_rows(N, D, V)
        for start in range(0, N, C):
            h_c, t_c = h2[start:start + C], t[start:start + C]
            chunk_loss, grad = chunk_fn(h_c @ weight.t(), t_c, ignore_index, inv_n_valid)  # grad (C, V)
            loss_sum += chunk_loss
            if need_dh:
                torch.mm(grad, weight, out=dh[start:start + C])
            if need_dw:
                if weight.dtype == dw.dtype:
                    dw.addmm_(grad.t(), h_c)
                else:
                    dw += grad.t() @ h_c  # a (V, D) bf16 product, accumulated in fp32
            del grad  # free the chunk before the next one is allocated
        ctx.save_for_backward(dh, dw)
        ctx.hidden_shape, ctx.weight_dtype = hidden.shape, weight.dtype
        return loss_sum / n_valid.to(acc_dtype)

    @staticmethod
    def backward(ctx, dloss):
        dh, dw = ctx.saved_tensors
        grad_hidden = grad_weight = None
        if dh is not None:
            grad_hidden = (dh * dloss.to(dh.dtype)).view(ctx.hidden_shape)
        if dw is not None:
            grad_weight = (dw * dloss.to(dw.dtype)).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of hidden @ weight.T against targets, without materialising all the logits."""
    D = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != D:
        raise ValueError(f"linear_cross_entropy: weight {tuple(weight.shape)} must be (V, D) with D={D}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden.shape)} and targets "
                         f"{tuple(targets.shape)} must agree on all but hidden's last dim")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"linear_cross_entropy: hidden is {hidden.dtype} but weight is {weight.dtype}; "
                         "cast them to one dtype")
    use_kernels = use_triton(hidden)
    if use_kernels:
        check_dtype("linear_cross_entropy", hidden)
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"linear_cross_entropy: targets dtype {targets.dtype} must be int64 or int32")
    grad_on = torch.is_grad_enabled()
    return LinearCrossEntropyFn.apply(hidden, weight, targets, ignore_index, use_kernels,
                                      grad_on and hidden.requires_grad, grad_on and weight.requires_grad)
