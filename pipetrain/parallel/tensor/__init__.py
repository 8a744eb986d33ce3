"""Tensor parallelism: split Linears and the Embedding across tp ranks, from a name table.

Owns: layers.py (column/row/vocab-parallel layers, apply_tensor_parallel, tp-partial gradients),
cross_entropy.py (the vocab-parallel loss), fp8.py (float8 linears, their scales reduced over tp),
lora.py (LoRA adapters in every layout; kept whole here: its replicated and tensor-parallel variants
share one class swap and one init). May import: models,
config, kernels, parallel.mesh, parallel.pipeline.weight_grads, parallel.data.allreduce.
Never: trainer, build, cli, checkpoint.
"""
