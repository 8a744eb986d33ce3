"""Nothing is read from outside the folder given: the one rule on links, for data, model and tokenizer folders.

A link inside a folder is the folder's own when it leads inside it. A Hugging Face cache snapshot
(`models--org--name/snapshots/<revision>/`) is the one layout whose files lead out, each into its own
repository's `blobs/` folder, and those load. Anything else leading out is refused in one line, before the
folder is read. May import: pipetrain.config.
"""
from __future__ import annotations

import os

from pipetrain.config import ConfigError

DATA_FIX = "copy the file into the folder, or point data.path (or data.sources) at it"
MODEL_FIX = "copy the file into the folder (or save the model again with save_pretrained)"


def refuse_outside(folder: str, root: str, entry: str, target: str, where: str, fix: str = DATA_FIX) -> None:
    """ConfigError when target (entry's real path) is not root (folder's real path) or under it."""
    if target != root and not target.startswith(root + os.sep):
        raise ConfigError(f"{where}: {entry} links outside the folder {folder!r} (to {target}); {fix}")


def refuse_folder_links_outside(folder: str, where: str) -> None:
    """A model or tokenizer folder read only inside itself: every link in it, at any depth, leads inside it
    or, in a Hugging Face cache snapshot, into its repository's blobs folder. A folder that is itself a link is
    the folder it leads to."""
    root = os.path.realpath(folder)
    parent = os.path.dirname(root)
    snapshot = os.path.basename(parent) == "snapshots"
    blobs = os.path.realpath(os.path.join(os.path.dirname(parent), "blobs")) if snapshot else None
    for here, dirs, names in os.walk(folder):  # a link to a folder is an entry here, never walked into
        for name in dirs + names:
            entry = os.path.join(here, name)
            if not os.path.islink(entry):
                continue
            target = os.path.realpath(entry)
            if blobs is not None and target.startswith(blobs + os.sep):
                continue
            refuse_outside(folder, root, entry, target, where, MODEL_FIX)
