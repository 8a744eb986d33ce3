"""The hybrid parameter server for the input embedding: rows on server ranks, pulled and pushed by workers.

Owns: core.py (server, client, PSEmbedding and their messages; 520 lines,
kept whole: the split into server/client/protocol is left for later), state.py (server state,
checkpoints and the server log). May import: models, config, faults, optim.adamw, optim.torch_opt,
parallel.mesh. Never: trainer, build, cli, checkpoint.
"""
