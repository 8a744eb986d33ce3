"""Checkpoint tools without the original world size:

    python -m pipetrain.checkpoint inspect CKPT_DIR
    python -m pipetrain.checkpoint consolidate CKPT_DIR OUT_DIR [--max-shard-size 2GB]

consolidate writes the full model weights (pipetrain's global names) as safetensors, sharded with a
model.safetensors.index.json above the size threshold. It streams through the same writer as the
Hugging Face export (headers computed up front from the manifest's shapes; each tensor assembled
from its pieces and written at its offset), so peak memory stays near the largest single tensor.
"""
from __future__ import annotations

import json
import os
import sys

import torch

from pipetrain.checkpoint.read import TensorReader, model_tensors, read_manifest, verify_files
from pipetrain.config import ArgumentParser, ConfigError
from pipetrain.hf.export import DEFAULT_MAX_SHARD_BYTES, ShardedSafetensorsWriter, parse_size, prepare_out_dir

def consolidate(ckpt_dir: str, out_dir: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                overwrite: bool = False) -> list[str]:
    """Write the checkpoint's full model weights (pipetrain names) to out_dir; returns the file names.
    A folder that already holds model files is refused unless overwrite (then its old ones are removed)."""
    manifest = read_manifest(ckpt_dir)
    verify_files(ckpt_dir, manifest)  # sizes and SHA-256 of every file, before OUT is touched (as export does)
    reader = TensorReader(ckpt_dir, manifest, verify=False)  # verified above
    entries = model_tensors(manifest)
    dtypes = {dtype for _, _, dtype in entries}
    if len(dtypes) != 1:
        raise ConfigError(f"consolidate: {ckpt_dir} mixes model dtypes {sorted(dtypes)}; expected one")
    prepare_out_dir(out_dir, "consolidate", source_dir=ckpt_dir, overwrite=overwrite)
    writer = ShardedSafetensorsWriter(out_dir, {name: tuple(shape) for name, shape, _ in entries},
                                      getattr(torch, dtypes.pop()), max_shard_bytes)
    try:
        for name, shape, _ in entries:  # one tensor in memory at a time
            writer.write(name, reader.read(f"model/{name}", [0] * len(shape), shape))
    except BaseException:
        writer.abort()
        raise
    writer.close()
    with open(os.path.join(out_dir, "pipetrain_model.json"), "w") as f:
        json.dump({"step": manifest["step"], "model": manifest["recipe"]["model"]}, f, indent=1)
    return list(writer.filenames)


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
    parser = ArgumentParser(prog="python -m pipetrain.checkpoint", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_inspect = sub.add_parser("inspect", help="print step, layout, tensors and sizes")
    p_inspect.add_argument("ckpt")
    p_cons = sub.add_parser("consolidate", help="write the full model weights as safetensors")
    p_cons.add_argument("ckpt")
    p_cons.add_argument("out")
    p_cons.add_argument("--max-shard-size", default="2GB")
    p_cons.add_argument("--overwrite", action="store_true", help="replace the model files already in OUT")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "inspect":
            print(inspect(args.ckpt))
        else:
            files = consolidate(args.ckpt, args.out, parse_size(args.max_shard_size), args.overwrite)
            print(f"wrote {len(files)} file(s) to {args.out}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
