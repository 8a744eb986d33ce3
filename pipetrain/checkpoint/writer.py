"""Writing a checkpoint: every rank's file, then rank 0's manifest, the atomic rename and `latest`; in a
background thread under checkpoint.async.

A save writes into checkpoints/.tmp-step-..., fsyncs every file and the folder, then rank 0 writes the
manifest last, renames the folder to its final name and points `latest` at it: a crash mid-save leaves
the previous checkpoint as latest. Every process (parameter servers included) learns of any process's
failure by an all-gather after each phase, so all raise the same error (CheckpointSaveError for the file
system, ConfigError for a stray file in the way) and rank 0 removes the temporary folder.

Under checkpoint.async the same write runs on a thread (at most one in flight: the next save, or the end
of the run, waits for the previous one), its collectives on the gloo checkpoint group so they never
interleave with the training groups'; its error is raised on the training thread by wait().

May import: config, checkpoint.read, checkpoint.manifest, parallel.mesh.comm. Never: trainer, build, cli.
"""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Callable

from safetensors.torch import save_file

from pipetrain.checkpoint.manifest import file_metadata, seal
from pipetrain.checkpoint.read import checkpoint_dirs, file_sha256, step_dir_name, step_of
from pipetrain.config import ConfigError
from pipetrain.parallel.mesh.comm import all_gather_object


@dataclass
class Snapshot:
    """What one process saves for one step, taken at the step boundary: host copies under checkpoint.async,
    so training may go on while a background thread writes them."""
    step: int
    meta: dict                 # rank 0's run state for the manifest (Saveable.checkpoint_state)
    items: list                # (name, tensor, global shape, offsets), tensors on the host under async
    rng: dict                  # "rng/cpu" (and "rng/cuda") generator states


class CheckpointSaveError(RuntimeError):
    """A save failed on the file system (no space, permissions, quota); the previous checkpoint is intact."""


class CheckpointWriter:
    """Writes snapshots under root (a run's checkpoints/ folder) and keeps its newest `keep`."""

    def __init__(self, root: str, dims, keep: int):
        self.root, self.dims, self.keep = root, dims, keep
        self._thread: threading.Thread | None = None
        self._outcome: BaseException | None = None  # the background write's exception, once it ended
        self.events: list[tuple[str, int]] = []  # ("snapshot" | "written", step) in order, for tests

    def write(self, snap: Snapshot, manifest: Callable[[Snapshot, list[dict]], dict]) -> str:
        """Write snap now, on every process; manifest(snap, file entries) is rank 0's unsealed manifest."""
        self.events.append(("snapshot", snap.step))
        return self._write(snap, manifest, None)

    def start(self, snap: Snapshot, manifest: Callable[[Snapshot, list[dict]], dict]) -> str:
        """write() on a background thread; returns the folder it will have. Call wait() first."""
        assert self._thread is None, "checkpoint: a save is still in flight; wait() for it first"
        self.events.append(("snapshot", snap.step))
        group = self.dims.checkpoint_group()  # collectives of the writer thread stay off the training groups
        self._outcome = None
        self._thread = threading.Thread(target=self._background, args=(snap, manifest, group), daemon=True,
                                        name=f"checkpoint-{snap.step}")
        self._thread.start()
        return os.path.join(self.root, step_dir_name(snap.step))

    def _background(self, snap: Snapshot, manifest, group) -> None:
        try:
            self._write(snap, manifest, group)
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

    def _write(self, snap: Snapshot, manifest, group) -> str:
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
            failure = _attempt(lambda: self._commit(manifest(snap, entries), tmp, final, step), tmp)
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

    def _commit(self, manifest: dict, tmp: str, final: str, step: int) -> None:
        """Rank 0: manifest last, then the atomic rename and `latest`."""
        manifest = seal(manifest)
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync(tmp)
        old = None
        if os.path.exists(final):  # the same step saved before: set aside, and removed only once this one is in
            old = os.path.join(self.root, f".old-{step_dir_name(step)}")  # place (a crash keeps one of the two)
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        try:
            os.rename(tmp, final)
        except BaseException:
            if old is not None:
                os.rename(old, final)  # the first copy back where `latest` names it
            raise
        try:
            _fsync(self.root)
            _write_latest(self.root, step_dir_name(step))
        finally:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        self._rotate(step)

    def _rotate(self, step: int) -> None:
        """Keep the newest `keep` checkpoints up to step, the one just written. Folders past it (left by
        `--resume auto` falling back past damaged ones) are not counted: rotating by step number would
        delete the new save and keep them."""
        for path in [d for d in checkpoint_dirs(self.root) if step_of(d) <= step][:-self.keep]:
            shutil.rmtree(path, ignore_errors=True)


def set_aside_later(root: str, step: int) -> tuple[str, int] | None:
    """A run resumed from step, an earlier checkpoint of its own (a rollback): its checkpoints past step belong to
    the trajectory being left. Kept where they are, the new saves would sit among them: rotation (newest steps
    kept) would delete the new saves, and `--resume auto` and a relaunch would take the abandoned ones. They
    move, whole, to a folder of their own under root that neither counts (checkpoint_dirs reads step-* folders
    only), and `latest` names step's folder. Returns (that folder, how many moved), or None when none is later."""
    later = [d for d in checkpoint_dirs(root) if step_of(d) > step]
    if not later:
        return None
    aside = os.path.join(root, f"abandoned-after-{step_dir_name(step)}-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(aside, exist_ok=True)
    for d in later:
        os.rename(d, os.path.join(aside, os.path.basename(d)))
    _write_latest(root, step_dir_name(step))
    return aside, len(later)


def restore_set_aside(root: str) -> None:
    """A process killed between a re-save's two renames (CheckpointWriter._commit) leaves the step's first
    copy under .old-step-N and no step-N: put it back. Where step-N is in place, the leftover goes."""
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        aside = os.path.join(root, name)
        if name.startswith(".old-step-") and os.path.isdir(aside) and not os.path.islink(aside):
            final = os.path.join(root, name[len(".old-"):])
            if os.path.lexists(final):
                shutil.rmtree(aside, ignore_errors=True)
            else:
                os.rename(aside, final)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    if os.path.lexists(tmp):  # a link of that name was written through (its target overwritten), then became latest
        os.remove(tmp)
    with open(tmp, "x") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, "latest"))
    _fsync(root)


def _gather(obj, dims, group=None) -> list:
    """obj of every process, parameter servers included."""
    return all_gather_object(obj, dims.full_world_size, group)
