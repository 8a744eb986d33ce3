"""Raw data that the readers under `python -m pipetrain.data prepare` cannot survive: refused in one line, exit 2,
before they see it. Run as a separate process: the failure this guards against is a crash of the process."""
from __future__ import annotations

import os
import shutil

from tests.harness import ROOT, run_script

RECIPE = os.path.join(ROOT, "recipes", "tiny.yaml")
TOKENIZER = os.path.join(ROOT, "pipetrain", "assets", "tokenizer")


def _prepare(data: str, cache: str, *sets: str):
    return run_script("pipetrain.data", ["prepare", "--recipe", RECIPE, "--set", f"data.path={data}",
                                         "--set", f"data.cache_dir={cache}", *(a for s in sets for a in ("--set", s))],
                      timeout=300)


def test_a_jsonl_record_nested_past_what_the_reader_parses_is_one_line_not_a_crash(tmp_path):
    """20,000 nested brackets in one record killed prepare with SIGSEGV (exit -11, no message) inside
    pyarrow's JSON reader; the records before it are fine."""
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.jsonl").write_text('{"text": "fine"}\n{"text": "x", "meta": ' + "[" * 20000 + "]" * 20000 + "}\n")
    proc = _prepare(str(raw), str(tmp_path / "cache"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, (proc.returncode,
                                                                                       proc.stderr[-2000:])
    assert lines[0].startswith("error: data.path: ") and "more than 100 deep (line 2)" in lines[0]


def test_a_tokenizer_config_nested_too_deep_is_one_line(tmp_path):
    """transformers failed on it (a RecursionError, turned into one line), then the look for auto_map code that
    names the cause read the same file again and raised RecursionError with a traceback."""
    tok = tmp_path / "tok"
    tok.mkdir()
    shutil.copy(os.path.join(TOKENIZER, "tokenizer.json"), tok)
    (tok / "tokenizer_config.json").write_text("[" * 100_000 + "]" * 100_000)
    proc = _prepare(os.path.join(ROOT, "pipetrain", "assets", "shakespeare"), str(tmp_path / "cache"),
                    f"data.tokenizer={tok}")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, (proc.returncode,
                                                                                       proc.stderr[-2000:])
    assert lines[0].startswith(f"error: data.tokenizer: cannot load '{tok}' (maximum recursion depth"), lines
