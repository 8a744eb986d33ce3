"""The stop guard's exit on ranks other than 0 (pipetrain/stopping.py): every rank exits, only global rank 0 prints
the one error line and removes the interrupted save's temporary folder (the others would repeat the line once per
rank and race rank 0 over the same folder on a shared file system).

Mutant killed (it survived the default suite, whose SIGTERM tests run one process):
  S02  every rank printing the line and removing the .tmp-step-* folder
"""
import os

import pytest

from pipetrain import stopping


class _Exited(Exception):
    pass


def _raise(code):
    raise _Exited(code)


@pytest.mark.parametrize("rank", [0, 1])
def test_only_rank_0_prints_and_cleans_up_on_a_stop_timeout(tmp_path, capsys, monkeypatch, rank):
    tmp = tmp_path / ".tmp-step-00000003"
    tmp.mkdir()
    monkeypatch.setattr(stopping.os, "_exit", _raise)
    guard = stopping.StopGuard(trainer=None, timeout_s=1.0, checkpoint_root=str(tmp_path), rank=rank)
    with pytest.raises(_Exited) as exited:
        guard._exit(stopping.STOP_TIMEOUT_EXIT, "error: the line")
    assert exited.value.args == (stopping.STOP_TIMEOUT_EXIT,)
    err = capsys.readouterr().err
    assert (err == "error: the line\n") if rank == 0 else (err == "")
    assert os.path.exists(tmp) == (rank != 0)
    guard._read.close()
    guard._write.close()
