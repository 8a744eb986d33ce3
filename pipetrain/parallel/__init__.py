"""Parallelism applied to the plain model from outside, one sub-package per axis or concern.

    mesh/      ParallelDims and the process groups, comm (the only collective caller), layout checks
    tensor/    column/row/vocab-parallel layers, the vocab-parallel loss, LoRA in any layout
    pipeline/  build_stage, schedules/ as data, the executor, the split backward, recomputation
    data/      gradient sync over dp (bucketed all-reduce, norm and clipping), ZeRO
    replicas/  cross-replica wrappers: bsp, stale (ssp/dssp) and periodic (local SGD/DiLoCo) sync, DBS, torchft
    ps/        the parameter server for embedding tables

May import: models, config, kernels, optim.adamw / optim.torch_opt, faults, torch.distributed.
Never: trainer, build, cli (tests/unit/test_boundaries.py checks). Import the module you need
(pipetrain.parallel.mesh.comm, ...): this package re-exports nothing.
"""
