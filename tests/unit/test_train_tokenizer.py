"""scripts/train_tokenizer.py, which made the shipped tokenizer: it trains one that transformers loads, and
bad input is one line with exit 2, before anything is written."""
import json
import os
import subprocess
import sys

from tests.e2e.common import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "train_tokenizer.py")


def _run(*args, cwd):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def test_it_trains_a_tokenizer_that_transformers_loads(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("To be, or not to be, that is the question.\n" * 50)
    proc = _run("--vocab", "300", "--corpus", str(corpus), "--out", str(tmp_path / "tok"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    vocab = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())["model"]["vocab"]
    assert 257 < len(vocab) <= 300 and "<|endoftext|>" in vocab  # bytes, the separator, merges
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert tok.decode(tok("not to be")["input_ids"]) == "not to be"


def test_bad_input_is_one_line_and_exit_2_writing_nothing(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for args, problem in ((["--corpus", str(empty)], "no .txt files there"),
                          (["--vocab", "100", "--corpus", str(empty)], "cannot hold the 256 byte symbols"),
                          (["--vocab", "many"], "invalid int value")):
        proc = _run(*args, "--out", str(tmp_path / "tok"), cwd=tmp_path)
        assert proc.returncode == 2, (args, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and problem in lines[0], (args, proc.stderr)
    assert not (tmp_path / "tok").exists()
