"""Checks on raw data files before the `datasets` readers see them, and the one line a reader's failure becomes.

The readers (datasets' text, json and parquet builders over pyarrow) fail deep inside their own code on a
file that is not UTF-8, a jsonl line that is not a JSON object, or a parquet file that is not one: the user
gets the file named and the cause in one line instead (ConfigError, exit 2).
"""
from __future__ import annotations

import codecs
import re

import numpy as np

from pipetrain.config import ConfigError

UTF8_SUFFIXES = (".txt", ".text", ".md", ".jsonl", ".json")  # every suffix corpus.py reads as text or json
# Records nest a few levels (a chat: 4). pyarrow's JSON reader, under datasets, recurses per level: 20,000
# nested brackets crashed the process (SIGSEGV, no message) and 5,000 ran for minutes.
MAX_JSON_DEPTH = 100
_JSON_STRING = re.compile(rb'"[^"\\\n]*(?:\\.[^"\\\n]*)*"')  # a string literal's brackets are text, not nesting
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


def check_utf8(files: list[str], where: str) -> None:
    """ConfigError naming the file and offset when a text or json file (UTF8_SUFFIXES) is not UTF-8 (one
    streaming read each)."""
    for file in files:
        if not file.endswith(UTF8_SUFFIXES):
            continue
        decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                try:
                    decoder.decode(block)
                except UnicodeDecodeError as exc:
                    at = offset + exc.start - (len(exc.object) - len(block))  # exc.object: pending bytes + block
                    raise ConfigError(f"{where}: {file} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at "
                                      f"offset {at}); convert it, e.g. iconv -f latin1 -t utf-8") from None
                offset += len(block)
            try:
                decoder.decode(b"", final=True)
            except UnicodeDecodeError:
                raise ConfigError(f"{where}: {file} is not UTF-8 text (it ends inside a multi-byte character); "
                                  "convert it, e.g. iconv -f latin1 -t utf-8") from None


def check_json_depth(files: list[str], where: str, limit: int = MAX_JSON_DEPTH) -> None:
    """ConfigError naming the file and line where a .json/.jsonl file nests arrays and objects deeper than limit
    (one streaming read each, of whole lines: a JSON string holds no raw newline, so none spans two reads)."""
    for file in files:
        if not file.endswith((".jsonl", ".json")):
            continue
        depth, line = 0, 1
        with open(file, "rb") as f:
            while block := f.read(1 << 22) + f.readline():
                chars = np.frombuffer(_JSON_STRING.sub(b"", block), np.uint8)
                levels = depth + np.cumsum(np.isin(chars, _OPEN).astype(np.int64) - np.isin(chars, _CLOSE))
                if levels.size and int(levels.max()) > limit:
                    at = line + int(np.count_nonzero(chars[:int(np.argmax(levels > limit))] == ord("\n")))
                    raise ConfigError(f"{where}: {file} nests arrays/objects more than {limit} deep (line {at}), "
                                      "which the JSON reader cannot parse; flatten or remove that record")
                depth = int(levels[-1]) if levels.size else depth
                line += block.count(b"\n")


def unreadable(where: str, path: str, kind: str, exc: BaseException) -> ConfigError:
    """The one line for a reader that failed on path: the innermost cause's first line, and the fix."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    cause = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    hint = " (jsonl: one JSON object per line)" if kind == "json" else ""
    return ConfigError(f"{where}: {path!r} could not be read as {kind} ({type(exc).__name__}: {cause}); fix or "
                       f"remove the damaged file{hint}")
