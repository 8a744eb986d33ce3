"""What the device's kernels and train.precision change in the memory model (plan/memory.py, plan/loss.py).

On CUDA the Triton kernels run (kernels/dispatch.use_triton) and keep less for backward than the torch
references the CPU runs; bf16 and fp8 runs compute in bf16 under autocast, and fp8's linears keep their inputs
in float8. The CPU tests check the model in fp32 against the tensors autograd saves; a GPU's measured peaks in
bf16 and fp8 check these (docs/planner.md).
"""
from __future__ import annotations

from pipetrain.config import ConfigError, ModelConfig, Recipe
from pipetrain.kernels.dispatch import HAS_TRITON, kernel_mode
from pipetrain.plan.shapes import kv_rows

FP32 = 4


def loss_dtype_bytes(recipe: Recipe) -> int:
    """Bytes per element of the head's GEMMs: bf16 under autocast (bf16 and fp8 runs: the head is no fp8 linear)."""
    return 2 if recipe.train.precision in ("bf16", "fp8") else FP32


def triton_path(device_type: str) -> bool:
    """Whether a run on device_type takes the Triton kernels' path (kernels/dispatch.use_triton: CUDA where triton
    imports, unless PIPETRAIN_KERNELS=torch), whose ops keep less for backward than the torch references that the
    CPU runs. Checking a card this machine lacks (PIPETRAIN_DEVICE) on one without triton counts the references:
    more, never less."""
    try:
        mode = kernel_mode()
    except ValueError as exc:  # kernels/ raises ValueError (it knows nothing of pipetrain): bad input, one line
        raise ConfigError(str(exc)) from None
    return device_type == "cuda" and mode != "torch" and (HAS_TRITON or mode == "triton")


def fp8_linear_elements(m: ModelConfig, tp: int) -> int:
    """Weight elements of one block's fp8 linears (parallel/tensor/fp8.FP8_PLAN: q, k, v, o and a dense MLP's;
    a MoE's experts quantise in each call) on a tp rank: what fp8.Fp8WeightCache holds per block."""
    q, kv, f = m.n_heads * m.head_dim // tp, kv_rows(m, tp), m.ffn // tp
    mlp = 0 if m.is_moe else (2 if m.family == "gpt2" else 3) * f * m.d_model
    return (2 * q + 2 * kv) * m.d_model + mlp


def fp8_linear_input_savings(m: ModelConfig, tp: int, attention_keeps_output: bool, compiled: bool) -> float:
    """Bytes per token and block that train.precision=fp8 saves against bf16: its linears keep their inputs in
    float8 (1 byte, one copy per input: parallel/tensor/fp8.py) where bf16 keeps them in 2, the attention norm's
    and the MLP norm's outputs (whole under sequence parallelism, as the linears gather them) and the down
    linear's input (a MoE's experts: not counted). The attention output is the output projection's input, and
    also what the attention kernel keeps for its own backward where it keeps anything (attention_keeps_output:
    no recomputation and no context parallelism, whose core checkpoints its chunks): in bf16 the two share one
    tensor, so in fp8 the float8 copy comes on top of it (one byte more), unless inductor recomputes the cast
    from the kept output in the backward (compiled: no change); where the kernel keeps nothing, one byte less."""
    attn = m.n_heads * m.head_dim / tp
    attn_saving = (0 if compiled else -attn) if attention_keeps_output else attn
    down = 0 if m.is_moe else m.active_ffn / tp
    return 2 * m.d_model + attn_saving + down
