"""Sharded safetensors checkpoints: atomic save, exact resume, load into any layout.

Every tensor is saved as boxes of its global tensor: a piece is (file, offsets along each dim, shape).
Each process writes only what it owns; loading assembles, for each tensor a rank holds, the box it needs
from whichever pieces overlap it, reading only those slices, so any layout loads any other. Nothing is
pickled: tensors are safetensors, everything else JSON. Directory layout and guarantees:
docs/checkpoints.md.

Modules (import the one you need; this package re-exports nothing, so importing one module never
loads the others, and no caller depends on where a name happens to be re-exported from):
- save.py      the Saveable contract, owned_tensors (what a trainer rank writes), Checkpointer
- writer.py    Snapshot, CheckpointWriter (rank files, manifest, rename, `latest`, rotation; the
               background thread of checkpoint.async), CheckpointSaveError
- read.py      checkpoint_dirs, read_manifest, verify_files, TensorReader, iter_full_tensors,
               CorruptCheckpoint, base_reference
- load.py      load into this rank's objects, check_compatible, check_base, find_resumable
- manifest.py  the manifest's checksum and structural check against its files' headers
- resume.py    load_agreed: every process agrees on the checkpoint it resumes from
- tools.py     python -m pipetrain.checkpoint inspect|consolidate

May import: config, models, parallel.mesh.comm, parallel.data.grads, hf.export (tools.py only).
Never: trainer, build, cli.
"""
