"""Under torchrun a worker's `error:` line is what torchrun's failure summary names as the root cause
(pipetrain.cli.record_error writes it where torch.distributed.elastic reads a worker's error)."""
from __future__ import annotations

from tests.e2e.common import run_train


def test_torchrun_summary_names_the_error_line_as_root_cause(tmp_path):
    proc, _ = run_train(str(tmp_path), ["parallel.tp=3"], nproc=2)
    assert proc.returncode != 0  # torchrun's own exit code (1), whatever the worker's
    summary = proc.stderr[proc.stderr.index("Root Cause"):]
    # every rank exits 2 with the same line; torchrun reports the first it saw fail, and when the other rank's
    # exit 2 came first it may name this one as SIGTERMed after it wrote its error file (a race, not a fault)
    assert "exitcode  : 2" in summary or "exitcode  : -15" in summary, summary
    cause = [line for line in summary.splitlines() if "traceback :" in line]
    assert cause and cause[0].split("traceback : ", 1)[1].startswith("error: world size 2 is not divisible"), summary
    assert "To enable traceback" not in summary
