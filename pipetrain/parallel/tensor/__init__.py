"""Tensor parallelism: split Linears and the Embedding across tp ranks, from a name table.

Owns: layers.py (column/row/vocab-parallel layers, apply_tensor_parallel, tp-partial gradients),
cross_entropy.py (the vocab-parallel loss), fp8.py (float8 linears, their scales reduced over tp),
lora.py (where LoRA adapters live under tp; the adapter math is pipetrain/models/lora.py).
May import: models, config, kernels, parallel.mesh, parallel.pipeline.weight_grads, parallel.data.allreduce.
Never: trainer, build, cli, checkpoint.
"""
