"""Checkpoint tools without the original world size:

    python -m pipetrain.checkpoint inspect CKPT_DIR
    python -m pipetrain.checkpoint consolidate CKPT_DIR OUT_DIR [--max-shard-size 2GB]

consolidate writes the full model weights (pipetrain's global names) as safetensors, sharded with a
model.safetensors.index.json above the size threshold. It streams: each tensor is assembled from
its pieces and written straight to the file (the safetensors header is computed up front from the
manifest), so peak memory stays near the largest single tensor.
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import torch

from pipetrain.checkpoint import TensorReader, model_tensors, read_manifest, verify_files
from pipetrain.config import ConfigError

_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int64": "I64",
              "int32": "I32", "uint8": "U8", "int8": "I8", "bool": "BOOL"}
_SIZES = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "BOOL": 1}


def write_safetensors_streaming(path: str, entries: list[tuple[str, list[int], str]], produce) -> None:
    """Write a safetensors file tensor by tensor: entries give (name, shape, torch dtype name);
    produce(name) returns the tensor when its turn comes."""
    header, offset = {}, 0
    for name, shape, dtype in entries:
        st = _ST_DTYPES[dtype]
        nbytes = _SIZES[st] * int(torch.Size(shape).numel())
        header[name] = {"dtype": st, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keeps the data 8-byte aligned, as the reference writer does
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, dtype in entries:
            t = produce(name).contiguous()
            if list(t.shape) != list(shape) or str(t.dtype).replace("torch.", "") != dtype:
                raise ValueError(f"consolidate: {name} is {tuple(t.shape)} {t.dtype}, expected {shape} {dtype}")
            f.write(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _parse_size(text: str) -> int:
    units = {"KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "B": 1}
    t = text.strip().upper()
    for unit, scale in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(unit):
            return int(float(t[:-len(unit)]) * scale)
    return int(t)


def shard_plan(entries, max_bytes: int) -> list[list]:
    """Group tensors in order into files of at most max_bytes (a larger tensor gets its own file)."""
    shards, current, size = [], [], 0
    for e in entries:
        nbytes = _SIZES[_ST_DTYPES[e[2]]] * int(torch.Size(e[1]).numel())
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(e)
        size += nbytes
    if current:
        shards.append(current)
    return shards


def consolidate(ckpt_dir: str, out_dir: str, max_shard_bytes: int = 2 * 10 ** 9) -> list[str]:
    manifest = read_manifest(ckpt_dir)
    verify_files(ckpt_dir, manifest)
    reader = TensorReader(ckpt_dir, manifest)
    entries = model_tensors(manifest)
    os.makedirs(out_dir, exist_ok=True)
    shards = shard_plan(entries, max_shard_bytes)

    def produce(name):
        shape = manifest["tensors"][f"model/{name}"]["global_shape"]
        return reader.read(f"model/{name}", [0] * len(shape), shape)

    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(names, shards):
        write_safetensors_streaming(os.path.join(out_dir, file), shard, produce)
        weight_map.update({name: file for name, _, _ in shard})
    if len(shards) > 1:
        total = sum(_SIZES[_ST_DTYPES[d]] * int(torch.Size(s).numel()) for _, s, d in entries)
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(out_dir, "pipetrain_model.json"), "w") as f:
        json.dump({"step": manifest["step"], "model": manifest["recipe"]["model"]}, f, indent=1)
    return names


def inspect(ckpt_dir: str) -> str:
    manifest = read_manifest(ckpt_dir)
    lay = manifest["layout"]
    lines = [f"checkpoint {ckpt_dir}", f"  step {manifest['step']}  tokens {manifest.get('tokens')}  "
             f"format v{manifest['format_version']}",
             f"  layout dp={lay['dp']} tp={lay['tp']} pp={lay['pp']} zero={lay['zero']} "
             f"(world size {lay['world_size']})",
             f"  files {len(manifest['files'])}, {sum(f['bytes'] for f in manifest['files'].values()) / 1e6:.2f} MB",
             f"  data position {manifest['data']}"]
    total = 0
    for name, info in manifest["tensors"].items():
        n = int(torch.Size(info["global_shape"]).numel())
        total += n if name.startswith("model/") else 0
        lines.append(f"  {name:60s} {str(info['global_shape']):>16s} {info['dtype']:>9s} "
                     f"{len(info['pieces'])} piece(s)")
    lines.append(f"  model parameters: {total:,}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipetrain.checkpoint", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_inspect = sub.add_parser("inspect", help="print step, layout, tensors and sizes")
    p_inspect.add_argument("ckpt")
    p_cons = sub.add_parser("consolidate", help="write the full model weights as safetensors")
    p_cons.add_argument("ckpt")
    p_cons.add_argument("out")
    p_cons.add_argument("--max-shard-size", default="2GB")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "inspect":
            print(inspect(args.ckpt))
        else:
            files = consolidate(args.ckpt, args.out, _parse_size(args.max_shard_size))
            print(f"wrote {len(files)} file(s) to {args.out}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
