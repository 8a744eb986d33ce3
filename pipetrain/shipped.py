"""Shipped recipes: `--recipe tiny` (or `tiny.yaml`) names one when no such file exists.

The one copy in git is recipes/*.yaml at the top of the source tree; a wheel carries the same files as
pipetrain/recipes (setup.py maps the folder into the package), so an installed pipetrain finds them too.

A shipped recipe's relative paths are written against recipes/ in the source tree (`../pipetrain/assets/...`,
`../runs/tiny`). Found by name, it may sit inside an installed package, where nothing may be written: a path
that reaches shipped data (an existing file or folder inside the package) resolves there, and every other
relative path, run.output_dir always, resolves under the current directory instead (`../runs/tiny` ->
`./runs/tiny`). From the source tree's root both rules give the same paths as `--recipe recipes/tiny.yaml`.

May import: nothing of pipetrain (config imports this module).
"""
from __future__ import annotations

import glob
import os

PACKAGE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(PACKAGE)  # the folder holding pipetrain/: the source tree, or site-packages
SUFFIX = ".yaml"


def recipes_dir() -> str:
    """Installed: pipetrain/recipes (the wheel's copy); in a source tree: recipes/ beside pipetrain/."""
    inside = os.path.join(PACKAGE, "recipes")
    return inside if os.path.isdir(inside) else os.path.join(ROOT, "recipes")


def shipped_names() -> list[str]:
    return sorted(os.path.basename(p)[:-len(SUFFIX)] for p in glob.glob(os.path.join(recipes_dir(), "*" + SUFFIX)))


def find_shipped(name: str) -> str | None:
    """The shipped recipe file called `name` (with or without .yaml; `recipes/NAME` as the docs write it), or None."""
    head, stem = os.path.split(name[:-len(SUFFIX)] if name.endswith(SUFFIX) else name)
    if head not in ("", "recipes") or not stem:
        return None
    path = os.path.join(recipes_dir(), stem + SUFFIX)
    return path if os.path.isfile(path) else None


def recipe_file(path: str) -> str | None:
    """The file a `--recipe` argument reads: an existing path as given, else the shipped recipe of that name."""
    return path if os.path.isfile(path) else find_shipped(path)


def anchor_shipped_paths(raw: dict, path_keys) -> dict:
    """raw (a shipped recipe's YAML) with each relative path key rewritten as described in the module
    docstring: absolute inside the package for shipped data, `./...` (resolved against the current directory
    by config) for the rest. Hub names (no leading '.', nothing on disk) stay as written."""
    if not isinstance(raw, dict):
        return raw  # config reports the malformed top level
    base = os.path.join(ROOT, "recipes")

    def anchor(section: str, key: str, value):
        if not isinstance(value, str) or not value or os.path.isabs(os.path.expanduser(value)):
            return value
        at = os.path.normpath(os.path.join(base, value))
        if (section, key) != ("run", "output_dir") and os.path.exists(at) and \
                os.path.commonpath([at, PACKAGE]) == PACKAGE:
            return at
        if not value.startswith(".") and not os.path.exists(at):
            return value
        return "./" + os.path.relpath(at, ROOT)

    out = {}
    for section, body in raw.items():
        if not isinstance(body, dict):
            out[section] = body
            continue
        body = {k: anchor(section, k, v) if (section, k) in path_keys else v for k, v in body.items()}
        if section == "data" and isinstance(body.get("sources"), list):
            body["sources"] = [{**s, "path": anchor("data", "path", s["path"])} if isinstance(s, dict) else s
                               for s in body["sources"]]
        out[section] = body
    return out
