"""One run per output directory: run.output_dir/.pipetrain.lock, held by global rank 0.

The lock is an flock on the file (released by the kernel when the holder dies, however it dies); the
file's contents name the holder (host, pid) so a refusal can say who holds it. A file naming a holder
whose lock is free was left by a run that died: it is reported as stale and taken over. On a clean
exit the holder empties the file (it is not deleted: a second run could already have it open).
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
import sys

from pipetrain.config import ConfigError
from pipetrain.procs import pid_alive

LOCK_NAME = ".pipetrain.lock"


class RunLock:
    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, LOCK_NAME)
        self.fd: int | None = None

    def acquire(self) -> "RunLock":
        out = os.path.dirname(self.path)
        try:  # never through a link: a .pipetrain.lock linked elsewhere would have that file emptied on release
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as exc:
            what = "is a link" if os.path.islink(self.path) else f"cannot be opened ({exc.strerror or exc})"
            raise ConfigError(f"run.output_dir={out}: its lock file {self.path} {what}; make the folder writable "
                              "and remove anything else of that name, or choose another run.output_dir") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a pipe or a device named .pipetrain.lock
            os.close(fd)
            raise ConfigError(f"run.output_dir={out}: its lock file {self.path} is not a regular file; remove it, "
                              "or choose another run.output_dir")
        holder = _read_holder(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(f"run.output_dir={os.path.dirname(self.path)} is in use by another run "
                              f"({_describe(holder)}, lock {self.path}); wait for it to finish or choose another run.output_dir") from None
        if holder:
            alive = holder.get("host") == socket.gethostname() and pid_alive(holder.get("pid"))
            print(f"warning: {self.path}: taking over a stale lock of {_describe(holder)}"
                  f"{' (that pid now belongs to another process)' if alive else ' (no longer running)'}",
                  file=sys.stderr)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode(), 0)
        os.fsync(fd)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        os.ftruncate(self.fd, 0)
        os.close(self.fd)  # closing releases the flock
        self.fd = None


def _read_holder(fd: int) -> dict | None:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (ValueError, RecursionError):  # not JSON, or arrays nested too deep for json
        return {"host": "?", "pid": "?"}
    return holder if isinstance(holder, dict) else None


def _describe(holder: dict | None) -> str:
    return f"host {holder.get('host')}, pid {holder.get('pid')}" if holder else "holder unknown"
