"""Context parallelism (parallel.cp): every sequence split across the cp ranks of a mesh coordinate.

Owns: the load-balanced slicing of a batch (slicing.py: cp rank r keeps chunks r and 2cp-1-r of 2cp equal
chunks of every sequence, with their global positions) and the attention that sees the whole sequence
(attention.py: K and V all-gathered over cp, queries local, masks built from global positions for the
(local queries x all keys) block only). Everything else in the model is token-local and runs on the slice
unchanged. May import: models, config, parallel.mesh. Never: trainer, build, cli, checkpoint, data.
"""
