"""The hybrid parameter server for the input embedding: rows on server ranks, pulled and pushed by workers.

Owns: protocol.py (row ranges, the message header and ops, byte counts, required versions), client.py
(PSClient and PSEmbedding: the workers' side), server.py (Server: a server rank's rows, their AdamW state,
the protocol loop), state.py (server state, checkpoints and the server log). client and server import
protocol, never each other. May import: models, config, faults, optim.adamw, optim.torch_opt, parallel.mesh.
Never: trainer, build, cli, checkpoint.
"""
