"""Expert parallelism (parallel.ep): each MoE layer's experts sharded over the ep group, tokens moved there and
back by all-to-all.

Owns: dispatch.py (apply_expert_parallel: keep this ep rank's experts, replace MoE.dispatch_compute_combine
with the all-to-all dispatch), zero.py (ZeRO 1/2 with expert weights sharded over expert-dp and the rest
over dp). ep is carved out of dp (pipetrain.parallel.mesh.dims): the gradient sync of the experts over
expert-dp lives with the other gradient syncs in pipetrain.parallel.data.grads.
May import: models, config, optim, parallel.mesh, parallel.data. Never: trainer, build, cli, checkpoint.
"""
