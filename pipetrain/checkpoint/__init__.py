"""Sharded safetensors checkpoints: atomic save, exact resume, load into any layout.

Every tensor is saved as boxes of its global tensor: a piece is (file, offsets along each dim,
shape). Each rank writes only what it owns: model shards once per (tp, pp) coordinate (dp rank 0;
tensors replicated over tp only from tp rank 0) and its optimizer state (ZeRO shards from every dp
rank). Loading assembles, for each tensor a rank holds, the box it needs from whichever pieces
overlap it, reading only those slices (safetensors slicing), so any layout loads any other.

Directory (docs/checkpoints.md): checkpoints/step-00000100/{manifest.json, rank-00000.safetensors, ...} and
checkpoints/latest naming the newest complete one. A save writes into checkpoints/.tmp-step-...,
fsyncs every file, then renames; a crash mid-save leaves the previous checkpoint as latest.
Resuming (resume.py): rank 0 chooses by manifest, headers and sizes; each rank hashes what it reads.
Nothing is pickled: tensors are safetensors, everything else JSON.

RNG: the model has no dropout, so the only consumer of torch's RNG is end-of-run sampling. Each
rank's CPU (and CUDA) generator state is saved; a resume with the same layout restores it exactly;
a resume into another layout cannot map rank streams one to one, so each rank reseeds from
(train.seed, step, rank) and says so.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import threading
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pipetrain.checkpoint.manifest import check_manifest, file_metadata, seal
from pipetrain.config import ConfigError
from pipetrain.models.init import param_layout
from pipetrain.parallel.mesh.comm import all_gather_object, barrier_all
from pipetrain.parallel.data.grads import tied_copy_names

FORMAT_VERSION = 2  # 2: sealed manifest (manifest_sha256) and piece metadata in every file
_ARCH_KEYS = ("family", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden",
              "tie_embeddings", "qkv_bias", "lora_rank")  # lora_rank: adapters only load into adapters


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _box(shape, slices) -> list[int]:
    return [0 if s.start is None else s.start for s in slices] if slices else [0] * len(shape)


def owned_tensors(model, optimizer, dims,
                  trainable_only: bool = False) -> list[tuple[str, torch.Tensor, tuple, list[int]]]:
    """(global name, local tensor, global shape, offsets) of everything this rank writes (trainable_only:
    only parameters that train, i.e. LoRA's adapters, not the frozen base)."""
    out = []
    params = dict(model.named_parameters())
    # local_sgd / diloco: model/ holds the replicas' average, each replica's own under optim/replica<r>/
    params.update(getattr(optimizer, "checkpoint_params", dict)())
    skip = tied_copy_names(model)
    replicated_over_tp = set()
    for name, (shape, slices) in param_layout(model).items():
        if tuple(params[name].shape) == tuple(shape):
            replicated_over_tp.add(name)
        if name in skip or dims.dp_rank != 0 or (dims.tp_rank != 0 and name in replicated_over_tp):
            continue
        if trainable_only and not params[name].requires_grad:
            continue
        out.append((f"model/{name}", params[name].detach(), tuple(shape), _box(shape, slices)))
    for name, tensor, shape, offsets in optimizer.state_items():
        param_name = name.rsplit("/", 1)[-1]
        if param_name in skip or (dims.tp_rank != 0 and param_name in replicated_over_tp):
            continue
        sharded_over_dp = getattr(optimizer, "stage", 0) >= 1  # ZeRO: every dp rank owns a row shard
        if name.startswith("replica") and "/" in name:  # one replica's own state: written by each replica
            if dims.dp_shard_rank != 0 and (not sharded_over_dp or tensor.dim() == 0):
                continue
        elif dims.dp_rank != 0 and (not sharded_over_dp or tensor.dim() == 0):
            continue
        elif sharded_over_dp and getattr(dims, "dp_replicate_rank", 0) != 0:  # replicas hold the same rows
            continue
        out.append((f"optim/{name}", tensor.detach(), tuple(shape), list(offsets)))
    return out


@dataclass
class Snapshot:
    """What one rank saves for one step, taken at the step boundary: host copies under checkpoint.async,
    so training may go on while a background thread writes them."""
    step: int
    tokens: int
    data: dict                 # the loader's state
    items: list                # owned_tensors' (name, tensor, global shape, offsets), tensors on the host
    rng: dict                  # "rng/cpu" (and "rng/cuda") generator states


class Checkpointer:
    """Saves the trainer's state every checkpoint.every steps, at the end and on SIGTERM. With
    checkpoint.async, save() takes a host snapshot and returns; a background thread writes it (at most
    one save in flight: the next save, or the end of the run, waits for the previous one first)."""

    def __init__(self, output_dir: str, recipe, dims):
        self.root = os.path.join(output_dir, "checkpoints")
        self.recipe, self.dims = recipe, dims
        self.adapters_only = recipe.model.lora_rank is not None  # LoRA: the adapters plus a base reference
        self.base: dict | None = None  # base_reference(recipe), hashed once at the first save
        self.is_async = recipe.checkpoint.async_
        self._thread: threading.Thread | None = None
        self._outcome: BaseException | None = None  # the background save's exception, once it ended
        self.events: list[tuple[str, int]] = []  # ("snapshot" | "written", step) in order, for tests
        self._buffers: dict[str, torch.Tensor] = {}  # async: host copies, reused from save to save

    def save(self, trainer) -> str:
        """Write the checkpoint of trainer.step on every rank (under checkpoint.async: snapshot it and
        start writing it in the background; wait() finishes it). An OSError on any rank (no space,
        permissions, quota) raises CheckpointSaveError on every rank, naming the path and the free
        space, after rank 0 removed the temporary folder: the previous checkpoint stays `latest`.
        A stray non-directory where a checkpoint folder goes is a ConfigError."""
        self.wait()  # at most one save in flight
        ps = getattr(trainer, "ps", None)
        if ps is not None:  # parameter servers join this save (rank 0 tells them)
            ps.announce_save(trainer.step)
        if hasattr(trainer, "drain_replicas"):  # relaxed dp_sync: apply pending updates, average replicas
            trainer.drain_replicas()
        snap = self._snapshot(trainer, copy=self.is_async)
        self.events.append(("snapshot", snap.step))
        if not self.is_async:
            return self._write(snap, None)
        group = self.dims.checkpoint_group()  # collectives of the writer thread stay off the training groups
        self._outcome = None
        self._thread = threading.Thread(target=self._background, args=(snap, group), daemon=True,
                                        name=f"checkpoint-{snap.step}")
        self._thread.start()
        return os.path.join(self.root, step_dir_name(snap.step))

    def _background(self, snap: Snapshot, group) -> None:
        try:
            self._write(snap, group)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread by wait()
            self._outcome = exc

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def failed(self) -> bool:
        """The background save ended with an error (every rank's writer learns of any rank's failure)."""
        return self._thread is not None and not self._thread.is_alive() and self._outcome is not None

    def wait(self) -> None:
        """Finish the save in flight, if any; raise its error here, on the training thread."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread, outcome, self._outcome = None, self._outcome, None
        if outcome is not None:
            raise outcome

    def _snapshot(self, trainer, copy: bool) -> Snapshot:
        if hasattr(trainer, "checkpoint_items"):  # a parameter server: its rows of the table and their state
            items = trainer.checkpoint_items()
        else:
            items = owned_tensors(trainer.model, trainer.optimizer, self.dims, trainable_only=self.adapters_only)
        if copy:  # host copies: the next steps change the originals while the writer runs
            items = [(n, self._host_copy(n, t), g, o) for n, t, g, o in items]
            if self.dims.device.type == "cuda":  # the device-to-pinned copies were asynchronous
                torch.cuda.synchronize(self.dims.device)
        rng = {"rng/cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["rng/cuda"] = torch.cuda.get_rng_state(self.dims.device)
        return Snapshot(trainer.step, trainer.tokens_seen, trainer.loader.state_dict(), items, rng)

    def _host_copy(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """tensor copied into this name's host buffer, allocated at the first async save and reused after
        (the previous write has finished: one save in flight), so later snapshots pay no page faults."""
        buf = self._buffers.get(name)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            buf = self._buffers[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                                              pin_memory=tensor.is_cuda)
        return buf.copy_(tensor.detach(), non_blocking=tensor.is_cuda)

    def _write(self, snap: Snapshot, group) -> str:
        """Write snap into checkpoints/.tmp-step-..., then rank 0 commits it (manifest, rename, latest).
        group: the process group of the agreement collectives (None: the default group)."""
        dims, step = self.dims, snap.step
        final = os.path.join(self.root, step_dir_name(step))
        tmp = os.path.join(self.root, f".tmp-{step_dir_name(step)}")
        failure = None
        if dims.rank == 0:
            failure = _attempt(lambda: self._make_tmp(tmp, final), tmp)
        failure = _first(_gather(failure, dims, group))  # every rank learns of a failure, or none proceeds
        entry = None
        if failure is None:
            path = os.path.join(tmp, f"rank-{dims.rank:05d}.safetensors")
            entry = _attempt(lambda: self._write_rank_file(path, snap), path) or self._entry
        entries = _gather(entry, dims, group)
        failure = failure or _first(e for e in entries if e is not None and "error" in e)
        if dims.rank == 0 and failure is None:
            failure = _attempt(lambda: self._commit(snap, entries, tmp, final, step), tmp)
        failure = _first(_gather(failure, dims, group))
        if failure is not None:
            if dims.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            kind, message = failure["error"]
            raise (ConfigError if kind == "config" else CheckpointSaveError)(message)
        self.events.append(("written", step))
        return final

    def _make_tmp(self, tmp: str, final: str) -> None:
        for path in (self.root, tmp, final):
            if os.path.lexists(path) and not os.path.isdir(path):
                raise ConfigError(f"checkpoint: {path} exists and is not a directory; move it away so a "
                                  "checkpoint folder can be written there")
        os.makedirs(self.root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier attempt at this step
        os.makedirs(tmp)

    def _write_rank_file(self, path: str, snap: Snapshot) -> None:
        """This rank's file, fsynced; self._entry becomes its manifest entry."""
        items = snap.items
        tensors = {name: t.contiguous().cpu() for name, t, _, _ in items}
        tensors.update(snap.rng)
        save_file(tensors, path, metadata=file_metadata(items))
        _fsync(path)
        self._entry = {"file": os.path.basename(path), "sha256": file_sha256(path), "bytes": os.path.getsize(path),
                       "rank": self.dims.rank,
                       "pieces": [{"name": n, "offsets": list(o), "shape": list(t.shape), "global_shape": list(g),
                                   "dtype": str(t.dtype).replace("torch.", "")} for n, t, g, o in items]}

    def _commit(self, snap: Snapshot, entries: list[dict], tmp: str, final: str, step: int) -> None:
        """Rank 0: manifest last, then the atomic rename and `latest`."""
        manifest = self._manifest(snap, entries)
        if self.adapters_only:
            self.base = self.base or base_reference(self.recipe.model.init_from, self.recipe.train.seed)
            manifest["base"] = self.base
        manifest = seal(manifest)
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync(tmp)
        if os.path.exists(final):  # the same step saved before (e.g. a resumed run's final save)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync(self.root)
        _write_latest(self.root, step_dir_name(step))
        self._rotate()

    def _manifest(self, snap: Snapshot, entries: list[dict]) -> dict:
        tensors: dict[str, dict] = {}
        for e in entries:
            for piece in e["pieces"]:
                t = tensors.setdefault(piece["name"], {"global_shape": piece["global_shape"], "dtype": piece["dtype"],
                                                       "pieces": []})
                t["pieces"].append({"file": e["file"], "offsets": piece["offsets"], "shape": piece["shape"]})
        d = self.dims
        return {
            "format_version": FORMAT_VERSION,
            "step": snap.step,
            "tokens": snap.tokens,
            "recipe": self.recipe.to_dict(),
            "layout": {"dp": d.dp, "tp": d.tp, "pp": d.pp, "zero": self.recipe.parallel.zero,
                       "virtual_stages": self.recipe.parallel.virtual_stages, "world_size": d.world_size,
                       "dp_shard": d.dp_shard, "dp_replicate": d.dp_replicate,
                       "dp_sync": self.recipe.parallel.dp_sync,
                       "ps_servers": d.ps_servers},
            "tensors": tensors,
            "files": {e["file"]: {"sha256": e["sha256"], "bytes": e["bytes"]} for e in entries},
            "rng": {str(e["rank"]): e["file"] for e in entries},
            "data": snap.data,
            "lr_schedule": {"step": snap.step, "name": self.recipe.train.lr_schedule,
                            "warmup_steps": self.recipe.train.warmup_steps},
        }

    def _rotate(self) -> None:
        for path in checkpoint_dirs(self.root)[:-self.recipe.checkpoint.keep]:
            shutil.rmtree(path, ignore_errors=True)


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


def check_base(manifest: dict, init_from: str | None, seed: int, ckpt_dir: str) -> None:
    """An adapter-only checkpoint loads only onto the base it was trained on (ConfigError otherwise)."""
    saved, now = manifest["base"], base_reference(init_from, seed)
    if saved.get("sha256") != now.get("sha256") or saved.get("seed") != now.get("seed"):
        raise ConfigError(f"checkpoint {ckpt_dir} holds LoRA adapters trained on base {saved}, got base {now}; "
                          "set model.init_from (and train.seed) to the base the adapters were trained on")


class CorruptCheckpoint(ConfigError):
    """A checkpoint's manifest or files do not match (missing, truncated, wrong checksum, unreadable):
    `--resume auto` falls back to an older checkpoint; any other ConfigError (a checkpoint of another
    model, say) stops the resume."""


class CheckpointSaveError(RuntimeError):
    """A save failed on the file system (no space, permissions, quota); the previous checkpoint is intact."""


def _free_space(path: str) -> str:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return f"{shutil.disk_usage(path or '.').free / 1e6:,.1f} MB free"
    except OSError:
        return "free space unknown"


def _attempt(action, path: str) -> dict | None:
    """None when action() succeeds, else {"error": (kind, one-line message)} that can be all-gathered."""
    try:
        action()
    except ConfigError as exc:
        return {"error": ("config", str(exc))}
    except OSError as exc:  # safetensors reports write failures as its own error type: caught below
        where = exc.filename or path
        return {"error": ("os", f"checkpoint save failed writing {where}: {exc.strerror or exc} ({_free_space(where)}"
                                f"); the temporary folder was removed and the previous checkpoint stays latest")}
    except Exception as exc:  # noqa: BLE001 - safetensors' SafetensorError wraps the OSError of a full disk
        if type(exc).__name__ != "SafetensorError":
            raise
        return {"error": ("os", f"checkpoint save failed writing {path}: {exc} ({_free_space(path)}); the "
                                "temporary folder was removed and the previous checkpoint stays latest")}
    return None


def _first(failures) -> dict | None:
    return next((f for f in failures if f is not None), None)


def _write_latest(root: str, name: str) -> None:
    tmp = os.path.join(root, ".latest.tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, "latest"))
    _fsync(root)


def _barrier(dims) -> None:
    barrier_all(dims.full_world_size)


def _gather(obj, dims, group=None) -> list:
    """obj of every process, parameter servers included."""
    return all_gather_object(obj, dims.full_world_size, group)


# ---- reading ------------------------------------------------------------------------------------

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
    if not os.path.isfile(path):
        raise CorruptCheckpoint(f"checkpoint {ckpt_dir}: manifest.json is missing (an incomplete save?); "
                                "resume from another checkpoint")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptCheckpoint(f"checkpoint {path}: not valid JSON ({exc}); the file is corrupt") from None
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise CorruptCheckpoint(f"checkpoint {path}: format version {version!r} is newer than this pipetrain "
                                f"reads ({FORMAT_VERSION}); upgrade pipetrain")
    if isinstance(version, int) and version < FORMAT_VERSION:
        raise CorruptCheckpoint(f"checkpoint {path}: format version {version!r} has no manifest checksum, which "
                                f"this pipetrain requires (format {FORMAT_VERSION}); resume from a newer checkpoint")
    try:
        return check_manifest(manifest, ckpt_dir, check_files=check_files)
    except ConfigError as exc:  # every structural failure is damage to this checkpoint
        raise CorruptCheckpoint(str(exc)) from None


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

    def _open(self, file: str):
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

    def read(self, name: str, offsets, shape, dtype: torch.dtype | None = None) -> torch.Tensor:
        info = self.manifest["tensors"].get(name)
        if info is None:
            raise ConfigError(f"checkpoint {self.dir}: tensor {name} is not in the manifest; the checkpoint does "
                              "not match this model or optimizer")
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
                part = self._open(piece["file"]).get_slice(name)[src] if shape else \
                    self._open(piece["file"]).get_tensor(name)
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


def check_resume_dir(path: str) -> None:
    """ConfigError unless `--resume DIR` names a folder."""
    if not os.path.isdir(path):
        raise ConfigError(f"--resume {path}: no such checkpoint directory; pass a checkpoints/step-... folder or "
                          "--resume auto")


def find_resumable(output_dir: str, rank: int = 0, *, older_than: str | None = None) -> str | None:
    """Newest checkpoint in output_dir/checkpoints (older than the folder older_than names, when given)
    whose manifest is sealed and well formed and whose files' headers and sizes match it; reports and
    skips the others. None when there is none. Nothing is hashed here: a checkpoint may be far larger
    than one rank can hash within a collective's timeout, so each rank hashes the files it reads when
    it loads them (pipetrain.checkpoint.resume agrees on the outcome)."""
    paths = checkpoint_dirs(os.path.join(output_dir, "checkpoints"))[::-1]
    if older_than is not None:
        paths = [p for p in paths if os.path.basename(p) < os.path.basename(os.path.normpath(older_than))]
    for path in paths:
        try:
            verify_files(path, read_manifest(path), sha256=False)
            return path
        except ConfigError as exc:
            if rank == 0:
                print(f"warning: skipping checkpoint {path}: {exc}", file=sys.stderr)
    return None


def check_compatible(manifest: dict, recipe, ckpt_dir: str) -> None:
    saved = manifest["recipe"]["model"]
    now = recipe.to_dict()["model"]
    diffs = [f"model.{k}: checkpoint {saved.get(k)!r} vs recipe {now.get(k)!r}" for k in _ARCH_KEYS
             if saved.get(k) != now.get(k)]
    if diffs:
        raise ConfigError(f"checkpoint {ckpt_dir} does not match the recipe's model ({'; '.join(diffs)}); "
                          "resume with the recipe it was saved with")


def load(ckpt_dir: str, trainer_parts: dict, recipe, dims) -> dict:
    """Restore model, optimizer, data position and RNG into this rank's objects; returns the manifest.
    trainer_parts: {"model", "optimizer", "loader"}."""
    manifest = read_manifest(ckpt_dir)
    check_compatible(manifest, recipe, ckpt_dir)
    # checksums: each file this rank reads is hashed once before use (docs/checkpoints.md)
    reader = TensorReader(ckpt_dir, manifest, device=dims.device, verify=recipe.checkpoint.verify)
    model, optimizer, loader = trainer_parts["model"], trainer_parts["optimizer"], trainer_parts["loader"]
    params = dict(model.named_parameters())
    adapters_only = "base" in manifest  # LoRA: the frozen base came from init_from or the seed
    if adapters_only:
        check_base(manifest, recipe.model.init_from, recipe.train.seed, ckpt_dir)
    with torch.no_grad():
        for name, (shape, slices) in param_layout(model).items():
            if adapters_only and not params[name].requires_grad:
                continue
            saved_name = "model/embed.weight" if name in tied_copy_names(model) else f"model/{name}"
            p = params[name]
            p.copy_(reader.read(saved_name, _box(shape, slices), p.shape, p.dtype))
    optimizer.load_state_items(lambda name, global_shape, offsets, shape:
                               reader.read(f"optim/{name}", offsets, shape))
    loader.load_state_dict(manifest["data"])
    layout = manifest["layout"]
    same = (layout["dp"], layout["tp"], layout["pp"], layout.get("ps_servers", 0)) == \
        (dims.dp, dims.tp, dims.pp, dims.ps_servers)
    if same:
        rng_file = reader._open(manifest["rng"][str(dims.rank)])
        torch.set_rng_state(rng_file.get_tensor("rng/cpu"))
        if torch.cuda.is_available() and "rng/cuda" in rng_file.keys():
            torch.cuda.set_rng_state(rng_file.get_tensor("rng/cuda"), dims.device)
    else:
        torch.manual_seed(recipe.train.seed * 1_000_003 + manifest["step"] * 1009 + dims.rank)
    return manifest

