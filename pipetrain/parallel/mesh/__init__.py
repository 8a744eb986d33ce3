"""The device mesh and everything that talks across it.

Owns: ParallelDims (dims.py, the only creator of process groups and the device mesh), comm.py (every
collective and point-to-point call goes through it), layout.py (every rule a layout must satisfy,
written once). May import: config, torch.distributed, parallel.replicas.dbs and
parallel.pipeline.schedules (pure rules, for layout checks). Never: trainer, build, cli, checkpoint.
"""
