"""Optimizers: AdamW and its state, the inner optimizers, and the one the trainer drives.

Owns: build.py (build_optimizer, the replicated Optimizer, lr_at), adamw.py (AdamW state boxes shared
by every optimizer), inner.py (the inner optimizer of ZeRO, relaxed sync and the parameter server).
May import: models, config, lr_schedule, parallel. Never: trainer, build, cli.
Deliberately re-exports nothing: parallel.data.zero imports optim.adamw, and optim.build imports
parallel.data.zero, so an eager __init__ would make a cycle. Import pipetrain.optim.build.
"""
