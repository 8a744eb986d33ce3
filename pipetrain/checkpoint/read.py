"""Reading a checkpoint: its folders, its verified manifest, its files' checksums and any box of any
saved tensor (TensorReader), without the layout it was saved with.

Loading, `inspect`, `consolidate`, the Hugging Face export and generation all read through here: a
manifest is trusted only once sealed and well formed (checkpoint/manifest.py) and a file only once its
size and SHA-256 match the manifest (each file hashed before its first read). A link at or below a step
folder is refused, so a checkpoint never makes a reader open a file from elsewhere.

A manifest's recipe.model must also build the model its tensors are: every model tensor's global shape is
the shape that recipe gives it (checked on a meta model, no memory), so no reader allocates, writes or
exports what the recipe claims and the files do not hold.

May import: config, jsonfile, models, checkpoint.manifest. Never: trainer, build, cli, parallel.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os

import torch
from safetensors import safe_open

from pipetrain.checkpoint.manifest import FORMAT_VERSION, check_manifest
from pipetrain.config import ConfigError, ModelConfig, clip
from pipetrain.config.schema import KEY_ALIASES
from pipetrain.jsonfile import read_json
from pipetrain.models import build, param_layout
from pipetrain.models.lora import is_adapter

MANIFEST_MAX_BYTES = 1 << 30  # ~150 bytes a piece: millions of pieces, far beyond any layout


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(ckpt_dir: str) -> int:
    """The step a checkpoint folder's name says (step_dir_name's inverse; -1 for a name that is no step)."""
    digits = os.path.basename(os.path.normpath(ckpt_dir))[len("step-"):]
    return int(digits) if digits.isascii() and digits.isdigit() else -1  # "step-\u00b2" is no step (int() refuses it)


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def slice_offsets(shape, slices) -> list[int]:
    """Where a local shard (slices of the global tensor, or None for the whole) starts along each dim."""
    return [0 if s.start is None else s.start for s in slices] if slices else [0] * len(shape)


class CorruptCheckpoint(ConfigError):
    """A checkpoint's manifest or files do not match (missing, truncated, wrong checksum, unreadable):
    `--resume auto` falls back to an older checkpoint; any other ConfigError (a checkpoint of another
    model, say) stops the resume."""


def checkpoint_dirs(root: str) -> list[str]:
    """Paths of the checkpoints under root (a run's checkpoints/ folder), oldest first: real step-*
    folders only. A link named step-* is no checkpoint of this run, so rotation never counts (or deletes
    through) one and a resume never picks one; root itself may be a link (to a scratch disk)."""
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, n) for n in sorted(os.listdir(root))
            if n.startswith("step-") and not os.path.islink(os.path.join(root, n))
            and os.path.isdir(os.path.join(root, n))]


def refuse_links(ckpt_dir: str) -> None:
    """CorruptCheckpoint when the step folder is a link or holds one: a checkpoint is its own files, and a
    link could make a load, an inspect or an export read a file from anywhere."""
    step = os.path.normpath(ckpt_dir)
    if os.path.islink(step) and os.path.basename(step).startswith("step-"):
        raise CorruptCheckpoint(f"checkpoint {ckpt_dir} is a symbolic link; a checkpoint folder holds its own "
                                "files: copy it instead of linking it")
    if os.path.isdir(step):
        for entry in os.scandir(step):
            if entry.is_symlink():
                raise CorruptCheckpoint(f"checkpoint {ckpt_dir}: {entry.name} is a symbolic link; a checkpoint "
                                        "holds only its own files: copy the file instead of linking it")


def read_manifest(ckpt_dir: str, check_files: bool = True) -> dict:
    """The checkpoint's manifest, verified (pipetrain.checkpoint.manifest.check_manifest): its checksum,
    its structure and, with check_files, the headers of the files it names. CorruptCheckpoint if not (a
    link at or below the step folder included)."""
    refuse_links(ckpt_dir)
    path = os.path.join(ckpt_dir, "manifest.json")
    if not os.path.lexists(ckpt_dir):
        raise CorruptCheckpoint(f"checkpoint {ckpt_dir}: no such folder; pass a checkpoints/step-... folder (or "
                                "--resume auto for a run's newest)")
    if os.path.isfile(ckpt_dir) or os.path.isdir(os.path.join(ckpt_dir, "checkpoints")):
        what = "a file" if os.path.isfile(ckpt_dir) else "a run folder"
        raise CorruptCheckpoint(f"checkpoint {ckpt_dir}: is {what}, not a checkpoint folder; pass a "
                                "checkpoints/step-... folder (or --resume auto for a run's newest)")
    if not os.path.isfile(path):
        raise CorruptCheckpoint(f"checkpoint {ckpt_dir}: manifest.json is missing (an incomplete save?); "
                                "resume from another checkpoint")
    manifest = read_json(path, "checkpoint", CorruptCheckpoint, "the file is corrupt, use another checkpoint",
                         MANIFEST_MAX_BYTES)
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise CorruptCheckpoint(f"checkpoint {path}: format version {version!r} is newer than this pipetrain "
                                f"reads ({FORMAT_VERSION}); upgrade pipetrain")
    if isinstance(version, int) and version < FORMAT_VERSION:
        raise CorruptCheckpoint(f"checkpoint {path}: format version {version!r} has no manifest checksum, which "
                                f"this pipetrain requires (format {FORMAT_VERSION}); resume from a newer checkpoint")
    try:
        manifest = check_manifest(manifest, ckpt_dir, check_files=check_files)
    except ConfigError as exc:  # every structural failure is damage to this checkpoint
        raise CorruptCheckpoint(str(exc)) from None
    problem = _model_shape_problem(manifest)
    if problem:
        raise CorruptCheckpoint(f"checkpoint {path}: its recipe.model does not build the model its tensors are "
                                f"({problem}); the manifest does not describe this checkpoint, use another one")
    return manifest


def checkpoint_model_config(manifest: dict) -> ModelConfig:
    """The ModelConfig a checkpoint was trained with (its manifest's recipe)."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    saved = {KEY_ALIASES.get(("model", k), k): v for k, v in manifest["recipe"]["model"].items()}  # head_dim
    return ModelConfig(**{k: v for k, v in saved.items() if k in fields})


@functools.lru_cache(maxsize=4)  # a pure memo: a resume reads one manifest several times, 1.6 s each at 70B
def _model_shapes(model_json: str) -> dict[str, list[int]]:
    """{parameter: global shape} of the model a recipe.model (as JSON) builds, on the meta device."""
    cfg = checkpoint_model_config({"recipe": {"model": json.loads(model_json)}})
    return {name: list(shape) for name, (shape, _) in param_layout(build(cfg, device="meta")).items()}


def _model_shape_problem(manifest: dict) -> str | None:
    """Where recipe.model and the model tensors disagree (None: they agree), on a meta model. LoRA's adapters
    are no tensors of the base model; every other model tensor must be one, of the recipe's shape."""
    try:
        shapes = _model_shapes(json.dumps(manifest["recipe"]["model"], sort_keys=True))
    except Exception as exc:  # noqa: BLE001 - any config the model refuses to build is the manifest's fault
        return f"it does not build: {clip(str(exc) or type(exc).__name__)}"
    for name, info in manifest["tensors"].items():
        if not name.startswith("model/") or is_adapter(name):
            continue
        want = shapes.get(name[len("model/"):])
        if want != info["global_shape"]:
            return (f"{name} is {info['global_shape']}, the recipe gives "
                    f"{want if want is not None else 'no such tensor'}")
    return None


def verify_files(ckpt_dir: str, manifest: dict, files=None, *, sha256: bool = True) -> None:
    """Check existence, size and (sha256) SHA-256 of the given (default: all) files against the manifest;
    CorruptCheckpoint if one does not match."""
    for name in files if files is not None else manifest["files"]:
        info = manifest["files"][name]
        path = os.path.join(ckpt_dir, name)
        if not os.path.isfile(path):
            raise CorruptCheckpoint(f"checkpoint {ckpt_dir}: file {name} is missing; the checkpoint is incomplete")
        if os.path.getsize(path) != info["bytes"]:
            raise CorruptCheckpoint(f"checkpoint {path}: {os.path.getsize(path)} bytes, manifest says "
                                    f"{info['bytes']} (truncated or overwritten); use another checkpoint")
        if sha256 and file_sha256(path) != info["sha256"]:
            raise CorruptCheckpoint(f"checkpoint {path}: SHA-256 does not match the manifest (corrupt); "
                                    "use another checkpoint")


class TensorReader:
    """Assembles any box of any saved tensor from the pieces that overlap it."""

    def __init__(self, ckpt_dir: str, manifest: dict, device="cpu", verify: bool = True):
        self.dir, self.manifest, self.device, self.verify = ckpt_dir, manifest, device, verify
        self.opened: set[str] = set()  # files read from (each verified before its first read)

    def open_file(self, file: str):
        """A safe_open handle on one of the checkpoint's files, verified before its first use."""
        # Each file is verified the first time this rank reads from it, so a rank hashes only the
        # files holding its slices. Opened per read, not cached: a long-lived handle keeps every page
        # it mapped resident, so streaming a large checkpoint would grow towards its whole size.
        if file not in self.opened:
            if self.verify:
                verify_files(self.dir, self.manifest, [file])
            self.opened.add(file)
        path = os.path.join(self.dir, file)
        try:
            return safe_open(path, framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types for bad headers
            raise CorruptCheckpoint(f"checkpoint {path}: cannot be read ({exc}); the file is corrupt") from None

    def _pieces(self, info: dict) -> list[dict]:
        """One piece per distinct box. State replicated over pipeline stages (the step count) is saved
        by each; take the copy in a file this rank already reads, so it never hashes another rank's
        whole file for one scalar."""
        by_box: dict[tuple, dict] = {}
        for piece in info["pieces"]:
            box = (tuple(piece["offsets"]), tuple(piece["shape"]))
            if box not in by_box or (piece["file"] in self.opened and by_box[box]["file"] not in self.opened):
                by_box[box] = piece
        return list(by_box.values())

    def read(self, name: str, offsets, shape, dtype: torch.dtype | None = None,
             global_shape=None) -> torch.Tensor:
        """The box offsets + shape of tensor name. global_shape: the whole tensor's shape in the model it is read
        into; a checkpoint whose tensor has another shape is refused (ConfigError), where reading a box of it
        would load part of a larger tensor (fewer experts, a smaller head_dim) or call a smaller one incomplete."""
        info = self.manifest["tensors"].get(name)
        if info is None:
            raise ConfigError(f"checkpoint {self.dir}: tensor {name} is not in the manifest; the checkpoint does "
                              "not match this model or optimizer")
        if global_shape is not None and list(global_shape) != list(info["global_shape"]):
            raise ConfigError(f"checkpoint {self.dir}: tensor {name} has shape {list(info['global_shape'])} there "
                              f"and {list(global_shape)} in this recipe's model; set the model keys the checkpoint "
                              "was saved with (its recipe.yaml)")
        out = torch.empty(list(shape), dtype=getattr(torch, info["dtype"]), device="cpu")  # read on the host
        covered = 0
        for piece in self._pieces(info):
            lo = [max(a, b) for a, b in zip(offsets, piece["offsets"])]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, shape, piece["offsets"], piece["shape"])]
            if any(h <= l for l, h in zip(lo, hi)) and len(shape) > 0:
                continue
            src = tuple(slice(l - p, h - p) for l, h, p in zip(lo, hi, piece["offsets"]))
            dst = tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, offsets))
            try:
                part = self.open_file(piece["file"]).get_slice(name)[src] if shape else \
                    self.open_file(piece["file"]).get_tensor(name)
            except ConfigError:
                raise
            except Exception as exc:  # safetensors' own error types: a truncated or mangled file
                raise CorruptCheckpoint(f"checkpoint {os.path.join(self.dir, piece['file'])}: tensor {name} cannot "
                                        f"be read ({exc}); the file is truncated or corrupt") from None
            out[dst] = part
            covered += part.numel()
        if covered != out.numel():
            raise CorruptCheckpoint(f"checkpoint {self.dir}: tensor {name} box {list(offsets)}+{list(shape)} is only "
                                    f"partly saved ({covered} of {out.numel()} elements); the checkpoint is incomplete")
        return out.to(self.device, dtype=dtype or out.dtype)


def model_tensors(manifest: dict) -> list[tuple[str, list[int], str]]:
    """(global name, global shape, dtype) of every model tensor, in manifest order."""
    return [(name[len("model/"):], info["global_shape"], info["dtype"])
            for name, info in manifest["tensors"].items() if name.startswith("model/")]


def iter_full_tensors(ckpt_dir: str, names=None):
    """Yield (global name, full tensor) for the model weights, one at a time (HF export, consolidate)."""
    manifest = read_manifest(ckpt_dir)
    reader = TensorReader(ckpt_dir, manifest)
    for name, shape, _ in model_tensors(manifest):
        if names is None or name in names:
            yield name, reader.read(f"model/{name}", [0] * len(shape), shape)


def base_reference(init_from: str | None, seed: int) -> dict:
    """What an adapter-only (LoRA) checkpoint's frozen base is: model.init_from's folder with the SHA-256
    of each of its weight files, or (no init_from) the seeded initialisation of train.seed."""
    if not init_from:
        return {"init_from": None, "seed": seed}
    if not os.path.isdir(init_from):
        raise ConfigError(f"LoRA base model.init_from={init_from}: no such directory; point it at the Hugging "
                          "Face folder the adapters were trained on")
    files = sorted(f for f in os.listdir(init_from) if f.endswith(".safetensors"))
    return {"init_from": os.path.abspath(init_from),
            "sha256": {f: file_sha256(os.path.join(init_from, f)) for f in files}}
