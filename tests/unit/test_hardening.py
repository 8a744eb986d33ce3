"""Hardening without training: torn metrics, the output-dir lock, pre-flight sizes, failed saves."""
import json

from pipetrain.build import _truncate_metrics


def test_torn_metrics_line_is_cut_back_with_a_warning(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2, 3)]
    path.write_text("\n".join(lines) + "\n" + '{"step": 4, "lo')  # killed mid-write
    _truncate_metrics(str(path), 2)
    assert path.read_text() == "\n".join(lines[:2]) + "\n"
    assert "line 4 is not a complete JSON record" in capsys.readouterr().err


def test_complete_metrics_lines_past_the_step_are_dropped_silently(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    _truncate_metrics(str(path), 3)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]
    assert capsys.readouterr().err == ""
