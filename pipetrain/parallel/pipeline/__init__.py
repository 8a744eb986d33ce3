"""Pipeline parallelism: split a model into stages and run schedules over them.

Owns: build_stage and partitioning (stage.py), schedules/ (actions as data, validator, simulator),
the executor, the split backward (weight_grads.py), activation recomputation per stage (recompute.py).
May import: models, config, parallel.mesh. Never: trainer, build, cli, checkpoint.
"""
