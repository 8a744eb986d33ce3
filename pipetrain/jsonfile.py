"""Reading a JSON file that came from outside this process (a checkpoint's manifest, a Hugging Face
config.json or weight index): bounded in size and failing with one line of the caller's error type.

The bound keeps a damaged or foreign file (say, a weight file renamed to manifest.json) from being read
whole into memory before it is refused. May import: the standard library only.
"""
from __future__ import annotations

import json


def read_json(path: str, where: str, error: type[Exception], fix: str, max_bytes: int):
    """The JSON value in path (the caller checks its type). error(`<where>: <path> ...; <fix>`) when the file
    cannot be read, holds more than max_bytes or is not JSON."""
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)  # never more than the bound, whatever the file's size
    except OSError as exc:
        raise error(f"{where}: {path} cannot be read, got {exc}; {fix}") from None
    if len(raw) > max_bytes:
        raise error(f"{where}: {path} holds more than the {max_bytes:,} bytes such a file may; {fix}")
    try:
        return json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise error(f"{where}: {path} is not valid JSON, got {exc}; {fix}") from None
    except RecursionError:  # arrays or objects nested deeper than Python's stack lets json parse
        raise error(f"{where}: {path} nests its JSON too deep to read; {fix}") from None
