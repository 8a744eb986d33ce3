"""The last pipeline stage's loss in the memory model (plan/memory.py): what the unfused head + loss or the fused
linear cross-entropy (train.fused_loss, kernels/linear_cross_entropy.py) holds on top of the blocks.

Unfused, a microbatch saves its fp32 logits (the log-softmax's output, counted per token in the activations) and
its backward holds three tensors of that size at once (loss_backward_bytes). Fused, the logits never exist
whole: the forward computes both gradients chunk by chunk and keeps them until the backward, the hidden states'
(per token, in the activations) and the head weight's (fused_loss_weight_grad, once per microbatch in flight),
and its temporaries are one chunk's (fused_loss_bytes). tokens: one microbatch's on this rank (rank_tokens).
"""
from __future__ import annotations

from pipetrain.config import Recipe
from pipetrain.kernels.linear_cross_entropy import chunk_rows
from pipetrain.plan.precision import FP32, loss_dtype_bytes


def fused_loss_weight_grad(recipe: Recipe) -> int:
    """Bytes of the head's weight gradient that the fused loss computes in a microbatch's forward and keeps until
    its backward: this tp rank's V/tp x D rows, in the dtype its GEMMs run in."""
    m, p = recipe.model, recipe.parallel
    return loss_dtype_bytes(recipe) * (m.vocab_size // p.tp) * m.d_model


def fused_loss_bytes(recipe: Recipe, tokens: int, device_type: str) -> int:
    """The fused loss's temporaries during a microbatch's forward, beside what it keeps: the (C, V/tp) chunk
    buffer its logits and their gradient share; in bf16 also autocast's bf16 copy of the head's weight and, on
    the CPU (the torch path), the chunk's fp32 copy for the softmax; under sequence parallelism the hidden states
    gathered along T for the head (tokens: the whole sequence's, as the head sees them)."""
    m, p = recipe.model, recipe.parallel
    vocab, elt = m.vocab_size // p.tp, loss_dtype_bytes(recipe)
    rows = min(tokens, chunk_rows(tokens, m.d_model, vocab, device_type))
    temp = elt * rows * vocab + (elt * tokens * m.d_model if p.sequence_parallel and p.tp > 1 else 0)
    if elt != FP32:
        temp += elt * vocab * m.d_model + (FP32 * rows * vocab if device_type == "cpu" else 0)
    return temp


def loss_backward_bytes(recipe: Recipe, tokens: int, kernels: bool = False) -> int:
    """The unfused loss's backward, on top of what it saved (counted in the activations). The torch path: the
    logits themselves (the executor still holds the stage output its loss was computed from; fp32 bytes also
    for bf16 logits, which the loss casts), the gradient of the log-softmax output and then of the logits: one
    microbatch's N x V/tp fp32 each, alive together while the log-softmax's backward runs. Measured: a V 65536
    parameter-server run peaked 258 MiB (two such tensors) above the model without this term, 23%
    (docs/benchmarks.md, issue 33). kernels (the Triton path, CUDA): its cross-entropy keeps the logits
    themselves (counted in the activations) and writes their gradient in their dtype, one tensor of that size."""
    m, p = recipe.model, recipe.parallel
    if kernels:
        return loss_dtype_bytes(recipe) * tokens * (m.vocab_size // p.tp)
    return 3 * FP32 * tokens * (m.vocab_size // p.tp)
