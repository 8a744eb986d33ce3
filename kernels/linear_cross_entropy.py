"""LM head + cross-entropy fused over chunks of tokens so the (N, V) logits never exist at once.

loss = mean over targets != ignore_index of cross_entropy(hidden @ weight.T, targets). The forward
walks the tokens in chunks of C rows and computes the gradients as it goes:
  logits_c = h_c @ W.T                  one GEMM in the input dtype, into a (C, V) buffer reused by every chunk
  g_c = (softmax - onehot) / n_valid    in place over logits_c, with the per-row loss (Triton: one kernel)
  dh[c] = g_c @ W                       written into a preallocated (N, D)
  dW += g_c.T @ h_c                     addmm_ into one (V, D) accumulator in the weight's dtype
The backward only scales dh and dW by the incoming gradient, in place, and hands them over.

FLOPs: the same three N*D*V GEMMs as eager (2*N*D*V each: logits, dh, dW); nothing is recomputed.
Bytes beyond the GEMMs' own operands, per element of the (N, V) logits: eager writes bf16 logits (2),
reads them and writes an fp32 copy (2 + 4), log_softmax reads and writes fp32 (4 + 4), the backward
writes an fp32 gradient and its bf16 cast (4 + 4 + 2 + 2), ~28 bytes; here the logits GEMM writes 2, the
kernel reads them twice (max/sum-exp pass, then the gradient pass; the second mostly from L2) and writes
2, ~8 bytes. At llama-3-8B shapes (N 8192, D 4096, V 128256, bf16) that is ~29 GB against ~8 GB of
memory traffic next to ~26 TFLOP of GEMMs, so the fused op should be GEMM-bound at the GEMMs' rate.
The dW accumulator costs one read + write of (V, D) per chunk after the first (mm, then addmm_ beta=1,
inside the GEMM's epilogue); with C >= D/2 rows, and 4096 on a GPU (GPU_MIN_CHUNK_ROWS; evening the
chunks out can leave them just over half that), that is a few passes, not the many of small chunks.

Precision: logits and gradients in the input dtype, softmax math in fp32 (as eager casts its logits to
fp32). dW accumulates in the weight's dtype: fp32 weights get an fp32 accumulator; bf16 weights (or
autocast's bf16 copy of fp32 masters) a bf16 one, where each chunk's GEMM sums in fp32 and adds the running
total (beta=1) before one rounding, so dW is rounded once per chunk (twice at the 8B shape on CUDA) instead of
once as eager's single GEMM does; the fp32 accumulator that the old design used cost a (V, D) fp32 buffer
plus a (V, D) bf16 temporary per chunk (most of its 110 ms and 5.1 GB).

Reentrancy: the gradients exist only once, in the forward's buffers. The backward scales them in place
(skipped when the incoming gradient is a CPU 1.0, where reading it is free; on a GPU the multiply is one
pass over the buffers, cheaper than a host sync) and gives them to autograd, which can then keep them as
.grad without a copy. So the graph may be back-propagated once: a second backward through the same
forward (retain_graph=True, torch.autograd.gradcheck's reentrancy check) raises RuntimeError. Tests check
the gradients against finite differences directly.

Vocabulary shards: `vocab_start` and `combine` let the caller hold only the rows [vocab_start,
vocab_start + V_local) of the head; combine(row_max, sum_exp, target_logit) merges each chunk's per-row
numbers over all shards (pipetrain.parallel.tensor.cross_entropy does it over tp; kernels know nothing
of processes). dh is then this shard's partial sum, which the caller's tp region reduces.

Autocast: under torch.autocast the op runs in the autocast dtype, as autocast runs the head's F.linear.
It is hidden from torch.compile (a graph break; dynamo is imported only when the op first runs): the chunk loop and its in-place buffers are already
what a compiled head + loss would be, and the loss sits outside the per-block compiled regions.
linear_cross_entropy_ref is the unfused spec, the test oracle only.

Returns an fp32 scalar (float64 for float64 inputs, which only the torch path takes).
Shapes: hidden (N, D) (or (..., D), flattened), weight (V, D) or a shard (V_local, D), targets (N,),
chunk logits (C, V).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .cross_entropy import cross_entropy_bwd, cross_entropy_fwd
from .dispatch import HAS_TRITON, check_dtype, tl, triton, use_triton
from .triton_helpers import num_warps_for

if HAS_TRITON:  # triton.jit functions: defined only with triton
    from .cross_entropy import row_max_sum_exp, store_grad_row

# See cross_entropy._MAX_BLOCK: 4096 fp32 values per loop iteration of a row (not tuned on a GPU).
_MAX_BLOCK = 4096

# Floor on the chunk for narrow models: below a few hundred rows the dW GEMM (inner dimension C) and
# its (V, D) read + write per chunk dominate (C = 4 at N=1024, D=512, V=128k was several times slower).
MIN_CHUNK_ROWS = 256
# The floor on a GPU. Each chunk after the first reads and writes the (V, D) dW accumulator, 4*V*D bytes in
# bf16, beside its dW GEMM's 2*C*V*D FLOPs: C/2 FLOPs a byte. An H100 or H200 does about 200 bf16 FLOPs per
# byte of HBM (990 TFLOP/s, 3.35-4.8 TB/s), so 4096 rows keep that traffic near a tenth of the dW GEMM's time.
# At D/2 = 1024 rows (d 2048) it was about 32 GB a step at vocab 128,256 (the llama 1.5B, 16 x 2048 tokens:
# 32 chunks), about 7 ms, where the H200 ran the fused loss 4 ms a step slower than the unfused head.
GPU_MIN_CHUNK_ROWS = 4096


def linear_cross_entropy_ref(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                             ignore_index: int = -100) -> torch.Tensor:
    """The unfused spec (test oracle): the full (N, V) logits, then fp32 cross-entropy."""
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()  # (N, V)
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), targets.reshape(-1),
                           ignore_index=ignore_index)


def chunk_rows(N: int, D: int, V: int, device_type: str = "cpu") -> int:
    """Tokens per chunk: C >= D/2 (the dW GEMM's inner dimension; 2048 at D=4096), C*V >= N*D (the
    chunk's logits may be as large as the hidden states), at least MIN_CHUNK_ROWS (GPU_MIN_CHUNK_ROWS on
    CUDA), at most N; then evened out so the last chunk is not a sliver. The (C, V) buffer is then at most
    half the (V, D) dW accumulator or the (N, D) hidden states, whichever is larger, or on CUDA 4096 rows
    (1 GB at vocab 128,256 in bf16, against 8.4 GB of logits for 32,768 tokens)."""
    floor = GPU_MIN_CHUNK_ROWS if device_type == "cuda" else MIN_CHUNK_ROWS
    C = min(N, max(-(-N * D // V), D // 2, floor))
    if C <= 0:
        return 1
    num_chunks = -(-N // C)
    return -(-N // num_chunks)


if HAS_TRITON:
    @triton.jit
    def _linear_cross_entropy_chunk_kernel(x_ptr, t_ptr, loss_ptr, scale_ptr, V, ignore_index,
                                           BLOCK: tl.constexpr):
        # One program per row of a chunk's logits: pass 1 the online max and sum of exp (and the
        # target's logit, read before pass 2 overwrites it), pass 2 the gradient (softmax - onehot) *
        # scale in place (scale = 1 / n_valid, 0 for an ignored row); the row's loss goes to loss_ptr.
        row = tl.program_id(0)
        base = row.to(tl.int64) * V  # int64: C * V passes 2**31 for real vocabularies
        t = tl.load(t_ptr + row)
        valid = t != ignore_index
        row_max, sum_exp = row_max_sum_exp(x_ptr, base, V, BLOCK)
        lse = row_max + tl.log(sum_exp)
        target_logit = tl.load(x_ptr + base + t, mask=valid, other=0.0).to(tl.float32)
        tl.store(loss_ptr + row, tl.where(valid, lse - target_logit, 0.0))
        store_grad_row(x_ptr, x_ptr, base, V, lse, t, tl.where(valid, tl.load(scale_ptr), 0.0), BLOCK)


def _chunk_triton(logits, t, ignore_index, inv_n_valid, vocab_start, combine):
    """Triton path: the chunk's loss sum; logits become the gradient in place. One kernel on a whole
    vocabulary; a shard needs the combined row numbers between the passes, so it runs cross_entropy's
    two kernels around combine."""
    C, V = logits.shape
    if combine is None:
        loss_rows = torch.empty(C, device=logits.device, dtype=torch.float32)
        block = min(triton.next_power_of_2(V), _MAX_BLOCK)
        _linear_cross_entropy_chunk_kernel[(C,)](logits, t, loss_rows, inv_n_valid, V, ignore_index, BLOCK=block,
                                                 num_warps=num_warps_for(block))
        return loss_rows.sum()
    row_max, sum_exp, target_logit = combine(*cross_entropy_fwd(logits, t, ignore_index, vocab_start))
    lse = row_max + torch.log(sum_exp)
    cross_entropy_bwd(logits, t, lse, inv_n_valid, ignore_index, vocab_start, out=logits)
    return torch.where(t != ignore_index, lse - target_logit, 0.0).sum()


def _chunk_torch(logits, t, ignore_index, inv_n_valid, vocab_start, combine):
    """CPU path: the same numbers from torch ops (fp32 math; float64 stays float64)."""
    V = logits.shape[1]
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (C, V); a copy only for bf16
    local_t = t - vocab_start
    hit = (t != ignore_index) & (local_t >= 0) & (local_t < V)
    safe_t = torch.where(hit, local_t, 0)[:, None]
    target_logit = torch.where(hit, x.gather(1, safe_t).squeeze(1), 0.0)
    row_max = x.amax(dim=-1)
    e = x.sub_(row_max[:, None]).exp_()  # (C, V) in place: over the logits, or over bf16's fp32 copy
    sum_exp = e.sum(-1)
    if combine is not None:
        global_max, sum_exp, target_logit = combine(row_max, sum_exp, target_logit)
        e.mul_(torch.exp(row_max - global_max)[:, None])
        row_max = global_max
    valid = t != ignore_index
    e.mul_((torch.where(valid, inv_n_valid, 0.0) / sum_exp)[:, None])  # softmax * scale
    e.scatter_add_(1, safe_t, -torch.where(hit, inv_n_valid, 0.0)[:, None])
    if e is not logits:
        logits.copy_(e)
    return torch.where(valid, row_max + sum_exp.log() - target_logit, 0.0).sum()


class LinearCrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, use_kernels, need_dh, need_dw, vocab_start=0,
                combine=None):
        D = hidden.shape[-1]
        h2 = hidden.reshape(-1, D).contiguous()  # (N, D)
        t = targets.reshape(-1).contiguous()  # (N,)
        weight = weight.contiguous()
        N, V = h2.shape[0], weight.shape[0]
        acc_dtype = torch.promote_types(h2.dtype, torch.float32)  # fp32, or float64 for the tests
        n_valid = (t != ignore_index).sum()
        inv_n_valid = (1.0 / n_valid.to(acc_dtype)).reshape(1)  # a device scalar: no host sync
        dh = torch.empty_like(h2) if need_dh else None
        dw = torch.empty_like(weight) if need_dw else None  # the accumulator: the weight's dtype
        loss_sum = torch.zeros((), device=h2.device, dtype=acc_dtype)
        chunk_fn = _chunk_triton if use_kernels else _chunk_torch
        C = chunk_rows(N, D, V, h2.device.type)
        buf = torch.empty(min(C, N), V, device=h2.device, dtype=h2.dtype)  # (C, V), reused by every chunk
        for start in range(0, N, C):
            h_c, t_c = h2[start:start + C], t[start:start + C]
            grad = torch.mm(h_c, weight.t(), out=buf[:h_c.shape[0]])  # logits, then their gradient in place
            loss_sum += chunk_fn(grad, t_c, ignore_index, inv_n_valid, vocab_start, combine)
            if need_dh:
                torch.mm(grad, weight, out=dh[start:start + C])
            if need_dw:
                if start == 0:
                    torch.mm(grad.t(), h_c, out=dw)
                else:
                    dw.addmm_(grad.t(), h_c)
        del buf
        ctx.grads = (dh, dw)  # handed over once by backward (module docstring: reentrancy)
        ctx.hidden_shape = hidden.shape
        return loss_sum / n_valid.to(acc_dtype)

    @staticmethod
    def backward(ctx, dloss):
        if ctx.grads is None:
            raise RuntimeError("linear_cross_entropy: a second backward through one forward; the op computes "
                               "its gradients in the forward and hands them over once (retain_graph is not "
                               "supported): call linear_cross_entropy again for another backward")
        dh, dw = ctx.grads
        ctx.grads = None
        if dloss.is_cuda or dloss.item() != 1.0:  # a CPU scalar is free to read; a GPU one would sync
            for g in (dh, dw):
                if g is not None:
                    g.mul_(dloss.to(g.dtype))
        return (None if dh is None else dh.view(ctx.hidden_shape)), dw, None, None, None, None, None, None, None


# A graph break (module docstring). torch._disable_dynamo is torch.compiler.disable without importing
# torch._dynamo until the first call, so importing pipetrain does not pay for it.
@torch._disable_dynamo
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                         *, vocab_start: int = 0, combine: Callable | None = None) -> torch.Tensor:
    """Mean cross-entropy of hidden @ weight.T against targets, without materialising all the logits.
    vocab_start / combine: weight holds a vocabulary shard (module docstring)."""
    D = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != D:
        raise ValueError(f"linear_cross_entropy: weight {tuple(weight.shape)} must be (V, D) with D={D}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden.shape)} and targets "
                         f"{tuple(targets.shape)} must agree on all but hidden's last dim")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):  # what autocast does to the head's F.linear
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    if hidden.dtype != weight.dtype:
        raise ValueError(f"linear_cross_entropy: hidden is {hidden.dtype} but weight is {weight.dtype}; "
                         "cast them to one dtype")
    use_kernels = use_triton(hidden)
    if use_kernels:
        check_dtype("linear_cross_entropy", hidden)
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"linear_cross_entropy: targets dtype {targets.dtype} must be int64 or int32")
    grad_on = torch.is_grad_enabled()
    with torch.autocast(device_type, enabled=False):  # the chunks' GEMMs run in the dtype chosen above
        return LinearCrossEntropyFn.apply(hidden, weight, targets, ignore_index, use_kernels,
                                          grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
                                          vocab_start, combine)
