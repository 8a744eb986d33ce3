"""Across data-parallel replicas: how replica groups exchange gradients and survive each other's faults.

Owns: wrapped.py (WrappedOptimizer, the base of the wrappers), relaxed.py (relaxed synchronisation,
parallel.dp_sync), dbs.py (dynamic batch sizing across replicas), failover.py (torchft replica groups).
May import: models, config, faults, optim.adamw, parallel.mesh, parallel.data, torchft (lazily).
Never: trainer, build, cli, checkpoint.
"""
