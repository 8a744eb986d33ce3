"""Which files a data folder holds: the files a prepare reads, each inside the folder given.

A folder's entries named as a data kind's files (.txt, .jsonl, .parquet, ...) are read; links inside it are
followed, each folder once; a link leading out of it, and an entry that is not a regular file, are refused
in one line (pipetrain.folders, which holds the same rule for model and tokenizer folders).
May import: pipetrain.config, pipetrain.folders.
"""
from __future__ import annotations

import os

from pipetrain.config import ConfigError
from pipetrain.folders import refuse_outside

_EXTENSIONS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json",
               ".parquet": "parquet"}


def source_files(path: str, where: str = "data.path") -> tuple[str, list[str]]:
    """(builder, files) for a local file or folder; ("", []) for a dataset name."""
    if os.path.isfile(path):
        files = [path]
    elif os.path.isdir(path):
        files = _walk_files(path, where)
        refuse_links_outside(path, files, where)
        _refuse_non_files(files, where)
        if not files:
            raise ConfigError(f"{where}: folder {path!r} has no .txt, .jsonl or .parquet files; "
                              "point it at a data folder or a prepared directory")
    elif os.path.isabs(path) or path.startswith("."):
        raise ConfigError(f"{where}: {path!r} not found; point it at a text/jsonl/parquet file or folder")
    else:
        return "", []
    kinds = {_EXTENSIONS.get(os.path.splitext(f)[1]) for f in files}
    if None in kinds or len(kinds) != 1:
        raise ConfigError(f"{where}: {path!r} must hold files of one kind (.txt, .jsonl or .parquet), "
                          f"got extensions {sorted({os.path.splitext(f)[1] for f in files})}")
    return kinds.pop(), files


def _walk_files(folder: str, where: str) -> list[str]:
    """The entries under folder named as a data kind's files, sorted, as paths through folder; hidden names
    skipped, as glob skips them. Links inside the folder are followed, but each folder is walked once: a link
    back up (`loop -> .`) made glob read every file again until the path grew too long (41 copies of one
    file, its validation documents copies of training ones), and two such links never ended. A folder link
    leading out of the folder is refused before anything under it is read."""
    root = os.path.realpath(folder)
    seen, found = {root}, []
    for parent, dirs, names in os.walk(folder, followlinks=True):
        walk = []
        for name in sorted(d for d in dirs if not d.startswith(".")):
            entry, target = os.path.join(parent, name), os.path.realpath(os.path.join(parent, name))
            refuse_outside(folder, root, entry, target, where)
            if os.path.splitext(name)[1] in _EXTENSIONS:
                found.append(entry)  # a folder named x.txt: _refuse_non_files names it
            if target not in seen:
                seen.add(target)
                walk.append(name)
        dirs[:] = walk
        found += [os.path.join(parent, n) for n in names
                  if not n.startswith(".") and os.path.splitext(n)[1] in _EXTENSIONS]
    return sorted(found)


def refuse_links_outside(folder: str, files: list[str], where: str) -> None:
    """Nothing outside the folder given is read: a file (or a folder on its way) that is a link leading out of
    it is refused (glob follows links). Links that stay inside are read as the files they point at."""
    root = os.path.realpath(folder)
    for f in files:
        refuse_outside(folder, root, f, os.path.realpath(f), where)


def _refuse_non_files(files: list[str], where: str) -> None:
    """Every entry read must be a regular file: a pipe would block its read forever, a folder named x.txt or a
    broken link fails deep in a reader."""
    for f in files:
        if not os.path.isfile(f):
            kind = "a broken link" if os.path.islink(f) and not os.path.exists(f) else \
                "a folder" if os.path.isdir(f) else "not a regular file (a pipe, a socket or a device)"
            raise ConfigError(f"{where}: {f} is {kind}; remove it from the folder or rename it")
