"""data.sources through train.py: a weighted blend of raw text sources is prepared, reported and trained."""
import os
import re

from tests.e2e.common import ROOT, run_train

PLAYS = os.path.join(ROOT, "pipetrain", "assets", "shakespeare")


def test_blend_of_two_text_files_reports_each_share_and_trains(tmp_path, token_cache):
    sources = []
    for play, weight in [("hamlet_gut.txt", 3), ("macbeth_gut.txt", 1)]:
        with open(os.path.join(PLAYS, play), encoding="utf-8") as f:
            text = f.read()[:20_000]  # ~5k tokens: 150 windows of 32, a second or so to prepare
        path = tmp_path / play
        path.write_text(text, encoding="utf-8")
        sources.append((str(path), weight))
    blend = "[" + ", ".join(f"{{path: '{path}', weight: {weight}}}" for path, weight in sources) + "]"
    proc, metrics = run_train(str(tmp_path / "run"), ["data.path=", f"data.sources={blend}", "train.steps=3"],
                              cache_dir=token_cache)
    assert proc.returncode == 0, proc.stderr[-4000:]
    shares = re.findall(r"^data: blend data\.sources\[(\d)\] (\S+): ([\d.]+)% of samples", proc.stdout, re.M)
    assert shares == [("0", sources[0][0], "75.0"), ("1", sources[1][0], "25.0")], proc.stdout[-2000:]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2, 3]


def test_eval_only_on_one_text_file_reports_an_eval_loss(tmp_path, token_cache):
    """The most common input, one .txt file, is one document: its last val_fraction of tokens is the
    validation split, the data line says so, and --eval-only reports a loss over those tokens."""
    with open(os.path.join(PLAYS, "hamlet_gut.txt"), encoding="utf-8") as f:
        (tmp_path / "one.txt").write_text(f.read()[:20_000], encoding="utf-8")
    proc, metrics = run_train(str(tmp_path / "run"), [f"data.path={tmp_path / 'one.txt'}"],
                              extra_args=["--eval-only"], cache_dir=token_cache)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = re.search(r"^data: data\.path .*: [\d,]+ tokens, 1 documents, [\d,]+ train / ([\d,]+) validation windows "
                     r"\(validation: the last 5\.0% of each document's tokens", proc.stdout, re.M)
    assert line and int(line.group(1).replace(",", "")) > 0, proc.stdout[-2000:]
    assert len(metrics) == 1 and metrics[0]["step"] == 0 and metrics[0]["eval_tokens"] > 0
    assert metrics[0]["eval_loss"] > 8.0  # an untrained model over 8192 tokens: about ln(8192) = 9.0
