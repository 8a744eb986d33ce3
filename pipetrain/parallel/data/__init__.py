"""Data parallelism inside a replica: gradient sync and ZeRO.

Owns: allreduce.py (bucketed gradient all-reduce over dp), grads.py (sync of dp, tp-partial and tied
gradients, the global norm and clipping), zero.py (ZeRO-1/2 sharded AdamW over dp_shard).
May import: models, config, optim.adamw, optim.inner, parallel.mesh, parallel.tensor.
Never: trainer, build, cli, checkpoint.
"""
