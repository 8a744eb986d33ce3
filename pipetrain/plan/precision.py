"""What the device's kernels and train.precision change in the memory model (plan/memory.py, plan/loss.py).

On CUDA the Triton kernels run (kernels/dispatch.use_triton) and keep less for backward than the torch
references the CPU runs; bf16 and fp8 runs compute in bf16 under autocast, and fp8's linears keep their inputs
in float8. The CPU tests check the model in fp32 against the tensors autograd saves; a GPU's measured peaks in
bf16 and fp8 check these (docs/planner.md).
"""
from __future__ import annotations

from pipetrain.config import ModelConfig, Recipe
from pipetrain.kernels.dispatch import kernel_mode

FP32 = 4


def loss_dtype_bytes(recipe: Recipe) -> int:
    """Bytes per element of the head's GEMMs: bf16 under autocast (bf16 and fp8 runs: the head is no fp8 linear)."""
    return 2 if recipe.train.precision in ("bf16", "fp8") else FP32


def triton_path(device_type: str) -> bool:
    """Whether a run on device_type takes the Triton kernels' path (kernels/dispatch.use_triton: CUDA, unless
    PIPETRAIN_KERNELS=torch), whose ops keep less for backward than the torch references that the CPU runs."""
    return device_type == "cuda" and kernel_mode() != "torch"


def fp8_linear_input_savings(m: ModelConfig, tp: int) -> float:
    """Bytes per token and block that train.precision=fp8 saves against bf16: its linears keep their inputs in
    float8 (1 byte, one copy per input: parallel/tensor/fp8.py), the attention norm's and the MLP norm's outputs
    (whole under sequence parallelism, as the linears gather them), the attention output and the down linear's
    input (a MoE's experts: not counted)."""
    down = 0 if m.is_moe else m.active_ffn / tp
    return 2 * m.d_model + m.n_heads * m.head_dim / tp + down
