"""The device mesh, everything that talks across it, and the rules a layout must satisfy.

Owns: ParallelDims (dims.py, the only creator of process groups and the device mesh), comm.py (every
collective and point-to-point call goes through it), rules.py (every rule on the parallel keys, with and
without a world size, written once). May import: config, torch.distributed, parallel.pipeline.schedules
(a schedule's own pure rules, which rules.py calls). Never: trainer, build, cli, checkpoint.
"""
