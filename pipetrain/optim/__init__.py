"""Optimizers: AdamW and its state, the torch optimizer every optimizer drives, and the one the trainer drives.

Owns: build.py (build_optimizer, the replicated Optimizer, lr_at), adamw.py (AdamW state boxes shared
by every optimizer), torch_opt.py (the torch optimizer, AdamW or SGD, that Optimizer, ZeRO and the
parameter servers hold as `torch_opt`). May import: models, config, lr_schedule, parallel. Never: trainer,
build, cli.
Deliberately re-exports nothing: parallel.data.zero imports optim.adamw, and optim.build imports
parallel.data.zero, so an eager __init__ would make a cycle. Import pipetrain.optim.build.
"""
