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
                                     b'{"step": 1, "loss": 2.0, "lr": "high"}\n'],
                         ids=["binary", "string-step", "null-loss", "string-eval", "string-lr"])
def test_a_damaged_metrics_file_exits_2_with_one_line(tmp_path, capsys, content):
    (tmp_path / "metrics.jsonl").write_bytes(content)
    assert plot_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: plot:") and "damaged" in err[0], err
