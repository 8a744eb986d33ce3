"""python -m pipetrain.plan's own arguments: --top below 1 listed nothing or a slice of the layouts (exit 0), and
--calibrate --out naming a folder failed after the minute of measuring, losing it; both are one line, exit 2,
before anything is measured."""
import os

import pytest

from pipetrain.plan.__main__ import main as plan_main

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "recipes",
                    "tiny.yaml")


def _one_error(capsys, code):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, (code, err)
    return err[0]


@pytest.mark.parametrize("top", ["0", "-1"])
def test_top_below_1_is_refused(capsys, top):
    line = _one_error(capsys, plan_main(["--recipe", TINY, "--nproc", "2", "--top", top]))
    assert f"--top: must be >= 1 (how many layouts to list), got {top}" in line


@pytest.mark.parametrize("where", ["folder", "missing-parent", "pipe"])
def test_calibrate_out_that_cannot_be_written_is_refused_before_measuring(capsys, tmp_path, monkeypatch, where):
    """pipe: the profile's write waited for a reader forever (a hang, after the measuring)."""
    measured = []
    monkeypatch.setattr("pipetrain.plan.__main__.calibrate", lambda **kw: measured.append(1))
    monkeypatch.setattr("pipetrain.plan.__main__.save_profile", lambda *a: measured.append(2))  # never blocks here
    out = {"folder": str(tmp_path), "missing-parent": str(tmp_path / "no" / "p.json"),
           "pipe": str(tmp_path / "p.json")}[where]
    if where == "pipe":
        os.mkfifo(out)
    code = plan_main(["--recipe", TINY, "--nproc", "2", "--calibrate", "--out", out])
    line = _one_error(capsys, code)
    assert f"--out {out}: " in line and {"folder": "is a folder", "missing-parent": "no folder",
                                         "pipe": "is not a regular file"}[where] in line
    assert measured == []
