"""Data parallelism inside a replica: gradient sync and ZeRO.

Owns: allreduce.py (bucketed gradient all-reduce over dp), grads.py (sync of dp, tp-partial and tied
gradients, the global norm and clipping), zero.py (ZeRO-1/2 sharded AdamW over dp_shard), zero3.py (ZeRO-3:
parameters sharded too, gathered per unit by hooks), flat.py (the flatten -> collective -> copy back helper
every multi-tensor exchange uses, here and in parallel.replicas).
May import: models, config, optim.adamw, optim.torch_opt, parallel.mesh, parallel.tensor.
Never: trainer, build, cli, checkpoint.
"""
