"""Prompt stopping: SIGTERM asks for a save at the next step boundary, bounded by run.stop_timeout_s.

Python runs signal handlers in the main thread between bytecodes, so a handler cannot act while the
main thread is inside one long torch operation (a step that never ends). The C-level handler does
write the signal number to the wakeup fd at once, though, so a watcher thread reading it sees every
signal immediately:

- first SIGTERM: sets the trainer's stop flag (the loop agrees on it across ranks after the step,
  saves and exits 0) and starts the clock;
- no clean exit within run.stop_timeout_s: one `error:` line and exit STOP_TIMEOUT_EXIT, without a
  save; a save in progress leaves only a `.tmp-*` folder, which rank 0 removes (checkpoints/latest is
  untouched, as after SIGKILL);
- a second SIGTERM, or SIGINT (Ctrl-C), at any time: exit at once (143 / 130), nothing saved.

Every rank runs its own guard. A rank that exits makes torchrun stop the others, so no rank waits
in a collective for one that left.
"""
from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import sys
import threading
import time

STOP_TIMEOUT_EXIT = 143  # 128 + SIGTERM: "terminated", what a scheduler expects of a signalled job
INTERRUPT_EXIT = 130     # 128 + SIGINT


def resume_point(checkpoint_root: str | None) -> str:
    """What a run that exits without saving leaves to resume from, for its exit line (read at exit: the
    last save may have landed after the signal)."""
    name = ""
    if checkpoint_root:
        try:
            with open(os.path.join(checkpoint_root, "latest")) as f:
                name = f.read().strip()
        except OSError:
            pass  # no checkpoint yet
    if name:
        return f"checkpoints/latest still names {name}, the newest checkpoint"
    return "no checkpoint was saved before: nothing to resume from, a restart begins at step 0"


class StopGuard:
    """Installed by the CLI around Trainer.fit (main thread only); uninstall() restores the handlers."""

    def __init__(self, trainer, timeout_s: float, checkpoint_root: str | None, rank: int):
        self.trainer, self.timeout_s, self.root, self.rank = trainer, timeout_s, checkpoint_root, rank
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)
        self._previous = {}
        self._deadline: float | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="pipetrain-stop-guard", daemon=True)

    def install(self) -> "StopGuard":
        for sig in (signal.SIGTERM, signal.SIGINT):
            # a Python-level handler must exist so the C handler does not kill the process; the
            # watcher thread does the work (the main thread may be stuck in a long torch call)
            self._previous[sig] = signal.signal(sig, lambda *_: None)
        self._previous_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        self._thread.start()
        return self

    def uninstall(self) -> None:
        self._done.set()
        signal.set_wakeup_fd(self._previous_fd)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._write.close()  # wakes the watcher, which then returns
        self._thread.join(timeout=5)
        self._read.close()

    def _watch(self) -> None:
        while not self._done.is_set():
            timeout = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
            self._read.settimeout(timeout)
            try:
                data = self._read.recv(64)
            except socket.timeout:
                self._exit(STOP_TIMEOUT_EXIT, f"error: SIGTERM: the run did not reach a step boundary and save "
                                              f"within run.stop_timeout_s={self.timeout_s:g}; exiting without a "
                                              f"checkpoint ({resume_point(self.root)})")
                return
            except OSError:
                return
            if not data or self._done.is_set():
                return
            for signum in data:
                if signum == signal.SIGINT:
                    self._exit(INTERRUPT_EXIT, "interrupted: stopped before finishing (no partial checkpoint "
                                               "was written)")
                elif signum == signal.SIGTERM and self._deadline is not None:
                    self._exit(STOP_TIMEOUT_EXIT, "error: second SIGTERM: exiting at once without a checkpoint "
                                                  f"({resume_point(self.root)})")
                elif signum == signal.SIGTERM:
                    self._deadline = time.monotonic() + self.timeout_s
                    self.trainer.stop_requested = True

    def _exit(self, code: int, line: str) -> None:
        if self._done.is_set():  # the run finished cleanly meanwhile
            return
        if self.rank == 0:
            if self.root:  # no half state: an interrupted save's temporary folder goes
                for tmp in glob.glob(os.path.join(self.root, ".tmp-step-*")):
                    shutil.rmtree(tmp, ignore_errors=True)
            print(line, file=sys.stderr, flush=True)
        os._exit(code)  # the main thread may be inside a torch call that never returns
