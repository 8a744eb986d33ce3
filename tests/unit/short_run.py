"""One real short training run shared by the generate, metrics and plot tests (run once per session).

6 steps of the small e2e recipe, logging to the console every 3rd step, evaluating and saving a
checkpoint every 3 steps, with an 8-token sample at the end."""
from __future__ import annotations

import atexit
import functools
import shutil
import tempfile

from tests.e2e.common import run_train

LOG_EVERY, STEPS = 3, 6


@functools.cache
def short_run():
    """(output dir, completed train.py process, metrics records)."""
    out = tempfile.mkdtemp(prefix="pipetrain-short-run-")
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    proc, metrics = run_train(out, [f"train.steps={STEPS}", f"run.log_every={LOG_EVERY}", "run.eval_every=3",
                                    "checkpoint.every=3", "checkpoint.keep=2", "run.sample_tokens=8"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc, metrics
