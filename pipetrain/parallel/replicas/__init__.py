"""Across data-parallel replicas: how replica groups exchange gradients and survive each other's faults.

Owns: wrapped.py (WrappedOptimizer, the base of the wrappers, and ReplicaOptimizer, bsp across replicas),
stale.py (ssp / dssp: stale gradients within a staleness bound), periodic.py (local SGD / DiLoCo: local
steps, periodic averaging, the outer optimizer), dbs.py (dynamic batch sizing across replicas), failover.py
(torchft replica groups). parallel.dp_sync picks the wrapper (pipetrain.optim.build.REPLICA_SYNC).
May import: models, config, faults, optim.adamw, parallel.mesh, parallel.data, torchft (lazily).
Never: trainer, build, cli, checkpoint.
"""
