"""The manifest's own integrity: a checksum over its canonical form and a structural check against
the safetensors files it describes (docs/checkpoints.md, Integrity).

The checksum (`manifest_sha256`) is the SHA-256 of the manifest without that key, serialised as
canonical JSON (sorted keys, no spaces, ASCII): any edit of a value is caught, reordering keys is
not an edit. The structural check does not trust the checksum: every type, required key and dtype,
every piece's box against its tensor's global shape (the unique boxes tile it exactly), the step
against the directory name, and every piece against the header of the file it names (the tensor is
there, with that dtype and shape, and the file's own metadata records the same offsets and global
shape). Each check failure is a ConfigError naming the checkpoint; nothing here raises anything else.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct

import numpy as np

from pipetrain.config import ConfigError, section_type_problems

FORMAT_VERSION = 2  # 2: sealed manifest (manifest_sha256) and piece metadata in every file
CHECKSUM_KEY = "manifest_sha256"
FILE_METADATA_KEY = "pipetrain_pieces"  # safetensors __metadata__ entry: {name: {"offsets", "global_shape"}}
SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
                      "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
_MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
_STEP_DIR = re.compile(r"step-(\d+)$")


def canonical_sha256(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != CHECKSUM_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def seal(manifest: dict) -> dict:
    """The manifest with its checksum added (the last thing computed before it is written)."""
    return {**manifest, CHECKSUM_KEY: canonical_sha256(manifest)}


def file_metadata(items) -> dict[str, str]:
    """The safetensors metadata a rank writes into its file: where each of its pieces sits globally."""
    return {FILE_METADATA_KEY: json.dumps({name: {"offsets": [int(o) for o in offsets],
                                                  "global_shape": [int(g) for g in global_shape]}
                                           for name, _, global_shape, offsets in items})}


def _int(value, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _ints(value, length: int | None = None) -> bool:
    return isinstance(value, list) and all(_int(v) for v in value) and (length is None or len(value) == length)


def check_manifest(manifest, ckpt_dir: str, *, check_files: bool = True) -> dict:
    """Raise ConfigError unless the manifest is sealed, well formed and agrees with its files' headers."""
    where = f"checkpoint {os.path.join(ckpt_dir, 'manifest.json')}"
    if not isinstance(manifest, dict):
        raise ConfigError(f"{where}: the manifest is a JSON {type(manifest).__name__}, not an object; "
                          "the file is corrupt, use another checkpoint")
    if CHECKSUM_KEY not in manifest:
        raise ConfigError(f"{where}: no {CHECKSUM_KEY} (written by an older pipetrain, or edited); "
                          "use another checkpoint")
    try:
        actual = canonical_sha256(manifest)
    except ValueError:  # NaN/inf or a value JSON cannot hold
        actual = None
    if manifest[CHECKSUM_KEY] != actual:
        raise ConfigError(f"{where}: manifest checksum does not match its contents (edited or corrupt); "
                          "use another checkpoint")
    problem = _structure_problem(manifest, ckpt_dir)
    if problem is None and check_files:
        problem = _header_problem(manifest, ckpt_dir)
    if problem:
        raise ConfigError(f"{where}: {problem}; the manifest does not describe this checkpoint, use another one")
    return manifest


def _structure_problem(m: dict, ckpt_dir: str) -> str | None:
    for key, kind in (("format_version", int), ("step", int), ("tokens", int), ("recipe", dict), ("layout", dict),
                      ("tensors", dict), ("files", dict), ("rng", dict), ("data", dict)):
        if key not in m:
            return f"required key {key!r} is missing"
        if not (_int(m[key]) if kind is int else isinstance(m[key], kind)):
            return f"{key!r} should be a {'non-negative int' if kind is int else 'JSON object'}, got {m[key]!r:.60}"
    match = _STEP_DIR.match(os.path.basename(os.path.normpath(ckpt_dir)))
    if match and int(match.group(1)) != m["step"]:
        return f"step {m['step']} does not match the directory name {os.path.basename(os.path.normpath(ckpt_dir))}"
    if not isinstance(m["recipe"].get("model"), dict):
        return "recipe.model is missing"
    wrong = section_type_problems("model", m["recipe"]["model"])
    if wrong:
        return f"recipe.{wrong[0]}"
    layout = m["layout"]
    for key in ("dp", "tp", "pp", "world_size", "virtual_stages"):
        if not _int(layout.get(key), 1):
            return f"layout.{key} should be a positive int, got {layout.get(key)!r:.60}"
    if not _int(layout.get("zero")):
        return f"layout.zero should be a non-negative int, got {layout.get('zero')!r:.60}"
    if not _int(m["data"].get("samples")) or m["data"]["samples"] >= 2 ** 63:
        return f"data.samples should be a non-negative int, got {m['data'].get('samples')!r:.60}"
    files = m["files"]
    for name, info in files.items():
        if not name.endswith(".safetensors") or os.path.basename(name) != name or name.startswith("."):
            return f"file name {name!r} is not a safetensors file in the checkpoint directory"
        if not isinstance(info, dict) or not _int(info.get("bytes")) or not isinstance(info.get("sha256"), str) \
                or not re.fullmatch(r"[0-9a-f]{64}", info["sha256"]):
            return f"files[{name!r}] should be {{sha256: 64 hex digits, bytes: int}}, got {info!r:.80}"
    servers = layout.get("ps_servers", 0)
    if not _int(servers):
        return f"layout.ps_servers should be a non-negative int, got {servers!r:.60}"
    processes = layout["world_size"] + servers  # parameter servers save a file of their own too
    # the count first: a world_size of 1e12 spelled out every rank's name (a hang) before the comparison failed
    if len(m["rng"]) != processes or sorted(m["rng"]) != sorted(str(r) for r in range(processes)) or \
            any(not isinstance(f, str) or f not in files for f in m["rng"].values()):
        return f"rng should name a saved file for each of the {processes} ranks"
    if not m["tensors"]:
        return "no tensors"
    for name, info in m["tensors"].items():
        problem = _tensor_problem(name, info, files)
        if problem:
            return problem
    return None


def _tensor_problem(name: str, info, files: dict) -> str | None:
    if not isinstance(info, dict) or not _ints(info.get("global_shape")) or \
            any(n >= 2 ** 62 for n in info["global_shape"]):
        return f"tensors[{name!r}].global_shape should be a list of ints below 2**62"
    if not isinstance(info.get("dtype"), str) or info["dtype"] not in SAFETENSORS_DTYPES:
        return f"tensors[{name!r}].dtype {info.get('dtype')!r:.40} is not one of {sorted(SAFETENSORS_DTYPES)}"
    shape = info["global_shape"]
    pieces = info.get("pieces")
    if not isinstance(pieces, list) or not pieces:
        return f"tensors[{name!r}].pieces should be a non-empty list"
    boxes = set()
    for piece in pieces:
        if not isinstance(piece, dict) or not isinstance(piece.get("file"), str) or piece["file"] not in files or \
                not _ints(piece.get("offsets"), len(shape)) or not _ints(piece.get("shape"), len(shape)):
            return f"tensors[{name!r}] has a malformed piece {piece!r:.80}"
        if any(o + n > g for o, n, g in zip(piece["offsets"], piece["shape"], shape)):
            return f"tensors[{name!r}] piece {piece['offsets']}+{piece['shape']} lies outside global shape {shape}"
        boxes.add((tuple(piece["offsets"]), tuple(piece["shape"])))
    boxes = sorted(boxes)
    pair = _overlapping(boxes)  # the unique boxes must tile the tensor: no overlap, no gap
    if pair:
        return f"tensors[{name!r}] pieces {list(pair[0])} and {list(pair[1])} overlap"
    if sum(_numel(n) for _, n in boxes) != _numel(shape):
        return f"tensors[{name!r}] pieces do not cover global shape {shape}"
    return None


def _overlapping(boxes: list[tuple[tuple, tuple]]) -> tuple | None:
    """The offsets of two of the (offsets, shape) boxes that overlap, or None. A sweep along the dimension where
    the boxes start at the most places, each box compared at once with those still open there: comparing every pair
    in Python hung on a manifest giving one tensor 200,000 pieces."""
    lo = np.array([b[0] for b in boxes], dtype=np.int64).reshape(len(boxes), -1)  # (pieces, dims)
    hi = lo + np.array([b[1] for b in boxes], dtype=np.int64).reshape(len(boxes), -1)
    if lo.shape[1] == 0:  # a scalar: its unique boxes are one
        return None
    dim = int(np.argmax([len(np.unique(lo[:, k])) for k in range(lo.shape[1])]))
    open_ = np.empty(0, dtype=np.int64)
    for i in np.argsort(lo[:, dim], kind="stable"):
        open_ = open_[hi[open_, dim] > lo[i, dim]]
        hit = open_[np.all((lo[open_] < hi[i]) & (lo[i] < hi[open_]), axis=1)]
        if hit.size:
            return boxes[int(hit[0])][0], boxes[int(i)][0]
        open_ = np.append(open_, i)
    return None


def _numel(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def read_safetensors_header(path: str) -> tuple[int, dict]:
    """(header length, JSON header) of a safetensors file (8-byte little-endian length, then JSON);
    ValueError if malformed."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("shorter than a safetensors header")
        (length,) = struct.unpack("<Q", raw)
        if length > _MAX_HEADER_BYTES:
            raise ValueError(f"header length {length} is implausible")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return length, header


def _header_problem(m: dict, ckpt_dir: str) -> str | None:
    expected: dict[str, dict[str, tuple]] = {f: {} for f in m["files"]}
    for name, info in m["tensors"].items():
        for piece in info["pieces"]:
            expected[piece["file"]][name] = (info["dtype"], piece["shape"], piece["offsets"], info["global_shape"])
    for file, want in expected.items():
        path = os.path.join(ckpt_dir, file)
        if not os.path.isfile(path):
            return f"file {file} is missing"
        try:
            length, header = read_safetensors_header(path)
            metadata = header.pop("__metadata__", None) or {}
            placed = json.loads(metadata.get(FILE_METADATA_KEY, "null"))
            ends = [e["data_offsets"][1] for e in header.values()]
        except (OSError, ValueError, UnicodeDecodeError, AttributeError, TypeError, KeyError, IndexError,
                RecursionError) as exc:  # RecursionError: JSON nested deeper than json can parse
            return f"file {file} has no readable safetensors header ({exc!r:.80})"
        if not isinstance(placed, dict):
            return f"file {file} does not record where its pieces belong (not written by this pipetrain)"
        if not all(_int(e) for e in ends) or os.path.getsize(path) != 8 + length + max(ends, default=0):
            return f"file {file} size does not match its header (truncated?)"
        saved = {n for n in header if not n.startswith("rng/")}
        if saved != set(want):
            extra, missing = sorted(saved - set(want)), sorted(set(want) - saved)
            return f"file {file} holds tensors {extra[:3]} the manifest does not list, lacks {missing[:3]}"
        for name, (dtype, shape, offsets, global_shape) in want.items():
            entry, where = header[name], placed.get(name)
            if not isinstance(entry, dict) or entry.get("dtype") != SAFETENSORS_DTYPES[dtype] or \
                    entry.get("shape") != shape:
                return (f"tensor {name} in {file} is {entry.get('dtype') if isinstance(entry, dict) else '?'} "
                        f"{entry.get('shape') if isinstance(entry, dict) else '?'}, manifest says {dtype} {shape}")
            if where != {"offsets": offsets, "global_shape": global_shape}:
                return (f"tensor {name} in {file} was saved at {where}, manifest says offsets {offsets} "
                        f"of {global_shape}")
        if file in m["rng"].values() and "rng/cpu" not in header:
            return f"file {file} holds no RNG state"
    return None
