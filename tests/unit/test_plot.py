"""python -m pipetrain.plot writes loss.png from a real run's metrics.jsonl."""
import os
import sys

import pytest

from pipetrain.plot import read_metrics
from pipetrain.plot.__main__ import main as plot_main
from tests.unit.short_run import STEPS, short_run
from tests.harness import run_script

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plot_command_writes_a_png_from_a_real_run():
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    out, _, _ = short_run()
    proc = run_script("pipetrain.plot", [out])
    assert proc.returncode == 0, proc.stderr
    png = os.path.join(out, "loss.png")
    assert proc.stdout.strip() == f"wrote {png}"
    with open(png, "rb") as f:
        assert f.read(8) == PNG_MAGIC and os.path.getsize(png) > 10_000
    steps, evals = read_metrics(out)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1)) and [r["step"] for r in evals] == [3, 6]


def test_missing_metrics_or_matplotlib_exit_2_with_one_line(tmp_path, capsys, monkeypatch):
    assert plot_main([str(tmp_path)]) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "lr": 0.1}\n')
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the extra were not installed
    assert plot_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 'pip install -e ".[plot]"' in err[0]


@pytest.mark.parametrize("content", [b"\x89PNG\r\n\x1a\n\x00\xff\xfe binary", b'{"step": "1", "loss": 2.0, "lr": 0.1}\n',
                                     b'{"step": 1, "loss": null, "lr": 0.1}\n', b'{"step": 1, "eval_loss": "x"}\n',
                                     b'{"step": 1, "loss": 2.0, "lr": "high"}\n',
                                     b'{"step": 1, "loss": 1' + b"0" * 400 + b', "lr": 0.1}\n',
                                     b'{"a": ' * 100_000 + b"1" + b"}" * 100_000 + b"\n"],
                         ids=["binary", "string-step", "null-loss", "string-eval", "string-lr", "huge-int",
                              "nested-deep"])
def test_a_damaged_metrics_file_exits_2_with_one_line(tmp_path, capsys, content):
    """huge-int: an integer of 401 digits overflowed in matplotlib; nested-deep: a RecursionError in json."""
    (tmp_path / "metrics.jsonl").write_bytes(content)
    assert plot_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: plot:") and "damaged" in err[0], err
    if b"high" in content:  # the field at fault is named, not the good ones
        assert "lr='high', not a finite number" in err[0] and "loss=" not in err[0], err


@pytest.mark.parametrize("content", [b'{"loss": 2.0, "lr": 0.1}\n', b'{"step": 1, "loss": 2.0}\n{"eval_loss": 2.0}\n'],
                         ids=["train-line", "eval-line"])
def test_a_metrics_line_without_its_step_exits_2_with_one_line(tmp_path, capsys, content):
    """It was a KeyError traceback: the line passed the number checks (a missing key read as 0.0)."""
    (tmp_path / "metrics.jsonl").write_bytes(content)
    assert plot_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: plot:") and "step=None, not a finite number" in err[0], err


def test_a_metrics_file_linked_from_outside_the_run_folder_is_not_read(tmp_path, capsys):
    """It was read and plotted (exit 0): a link leading out of the folder given."""
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_text('{"step": 1, "loss": 2.0, "lr": 0.1}\n')
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(outside, run / "metrics.jsonl")
    assert plot_main([str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metrics.jsonl links outside the folder" in err[0], err
    assert os.listdir(run) == ["metrics.jsonl"]


@pytest.mark.parametrize("where", ["missing-folder", "no-such-format", "a-folder"])
def test_an_out_path_that_cannot_be_written_is_one_line(tmp_path, capsys, where):
    pytest.importorskip("matplotlib")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "lr": 0.1}\n')
    out = {"missing-folder": tmp_path / "no" / "x.png", "no-such-format": tmp_path / "x.xyz",
           "a-folder": tmp_path / "loss.png"}[where]
    if where == "a-folder":  # the default RUN_DIR/loss.png is a folder
        out.mkdir()
    assert plot_main([str(tmp_path)] + ([] if where == "a-folder" else ["--out", str(out)])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"plot: cannot write {out}" in err[0], err


def test_out_a_folder_or_a_name_without_extension_writes_where_it_says(tmp_path, capsys):
    """Found by a review: --out an existing folder printed "wrote <folder>" and wrote <folder>.png beside it;
    a name without an extension got ".png" appended, unreported."""
    pytest.importorskip("matplotlib")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "lr": 0.1}\n')
    (tmp_path / "figs").mkdir()
    cases = ((tmp_path / "figs", tmp_path / "figs" / "loss.png"), (tmp_path / "curve", tmp_path / "curve.png"))
    for out, written in cases:
        assert plot_main([str(tmp_path), "--out", str(out)]) == 0
        assert capsys.readouterr().out.strip() == f"wrote {written}"
        with open(written, "rb") as f:
            assert f.read(8) == PNG_MAGIC
