"""Raw data that the readers under `python -m pipetrain.data prepare` cannot survive: refused in one line, exit 2,
before they see it. Run as a separate process: the failure this guards against is a crash of the process."""
from __future__ import annotations

import os

from tests.harness import ROOT, run_script

RECIPE = os.path.join(ROOT, "recipes", "tiny.yaml")


def _prepare(data: str, cache: str):
    return run_script("pipetrain.data", ["prepare", "--recipe", RECIPE, "--set", f"data.path={data}",
                                         "--set", f"data.cache_dir={cache}"], timeout=300)


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
