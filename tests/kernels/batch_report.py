"""pytest plugin for the kernel tests' subprocess fallback (see conftest.py): writes one JSON object
{nodeid: [outcome, text]} to the file named by PIPETRAIN_BATCH_REPORT when the session ends."""
import json
import os

_RESULTS = {}


def pytest_runtest_logreport(report):
    outcome, text = _RESULTS.get(report.nodeid, ("passed", ""))
    if report.failed:
        outcome, text = "failed", f"{text}\n[{report.when}] {report.longreprtext}"
    elif report.skipped and outcome == "passed":
        outcome, text = "skipped", str(report.longrepr)
    elif report.when == "call" and outcome == "passed":
        text = "called"  # a pass needs a call phase that passed, not just a clean setup
    _RESULTS[report.nodeid] = (outcome, text)


def pytest_sessionfinish(session):
    with open(os.environ["PIPETRAIN_BATCH_REPORT"], "w") as f:
        json.dump(_RESULTS, f)
