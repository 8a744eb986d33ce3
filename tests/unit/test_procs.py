"""pipetrain.procs.pid_alive, the one liveness check of the output-dir lock and of prepare's temp folders."""
import json
import os
import socket
import subprocess
import sys

import pytest

from pipetrain.data.corpus import remove_dead_temps
from pipetrain.procs import pid_alive
from pipetrain.run_lock import LOCK_NAME, RunLock


def _reaped_pid() -> int:
    """The pid of a child that has exited and been waited for: no process has it (until the kernel reuses it)."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           check=True)
    return int(child.stdout)


def test_pid_alive_tells_a_running_process_from_an_exited_one():
    assert pid_alive(os.getpid())
    assert not pid_alive(_reaped_pid())


@pytest.mark.parametrize("pid", [0, -1, None, "123", True, 1.0, 10 ** 30])
def test_pid_alive_never_takes_a_group_or_a_non_integer_for_a_process(pid):
    """A lock file or folder name may hold anything; os.kill(0 or -N, 0) would ask about a process group, and
    a pid past a C long was an OverflowError."""
    assert not pid_alive(pid)


@pytest.mark.parametrize("content", ["[" * 4096, json.dumps({"host": socket.gethostname(), "pid": 10 ** 30})],
                         ids=["nested-deep", "pid-past-a-c-long"])
def test_a_lock_file_holding_anything_is_taken_over_as_stale(tmp_path, capsys, content):
    """They were a RecursionError in json and an OverflowError in os.kill: train.py exited 1 with a traceback."""
    (tmp_path / LOCK_NAME).write_text(content)
    RunLock(str(tmp_path)).acquire().release()
    assert "taking over a stale lock" in capsys.readouterr().err


def test_a_stale_lock_naming_pid_0_is_reported_as_no_longer_running(tmp_path, capsys):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": 0}))
    RunLock(str(tmp_path)).acquire().release()
    assert "(no longer running)" in capsys.readouterr().err


def test_prepare_removes_only_the_temp_folders_whose_writer_is_gone(tmp_path):
    out = tmp_path / "prepared"
    prefix = f"{out}.tmp-{socket.gethostname()}-"
    live, dead, group, huge = (f"{prefix}{pid}" for pid in (os.getpid(), _reaped_pid(), 0, 10 ** 30))
    for path in (live, dead, group, huge):
        os.makedirs(path)
    assert sorted(remove_dead_temps(str(out))) == sorted([dead, group, huge])
    assert os.path.isdir(live) and not os.path.exists(dead) and not os.path.exists(group)
