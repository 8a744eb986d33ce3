"""tests.harness.run_script, through which the e2e tests run train.py and the tools: it must report what
`python script` would (exit status, both streams, environment, directory), or those tests check nothing."""
import os
import subprocess
import sys

import pytest

from tests.harness import run_script

SCRIPT = """
import os, sys
print("out", os.environ.get("PROBE"), os.getcwd(), sys.argv[1:])
os.write(2, b"raw err\\n")  # below Python's sys.stderr, as C code writes
if sys.argv[1] == "exit":
    sys.exit(int(sys.argv[2]))
if sys.argv[1] == "raise":
    raise RuntimeError("boom")
if sys.argv[1] == "kill":
    os.kill(os.getpid(), 9)
if sys.argv[1] == "hang":
    import time
    time.sleep(60)
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return str(path)


@pytest.mark.parametrize("args,code", [(["exit", "0"], 0), (["exit", "2"], 2), (["raise"], 1), (["kill"], -9),
                                       (["done"], 0)])
def test_exit_status_and_streams_are_the_interpreters(script, tmp_path, args, code):
    env = dict(os.environ, PROBE="seen")
    forked = run_script(script, args, env, cwd=str(tmp_path))
    real = subprocess.run([sys.executable, script, *args], env=env, cwd=str(tmp_path), capture_output=True, text=True)
    assert forked.returncode == real.returncode == code, (forked, real)
    assert forked.stdout == real.stdout == f"out seen {tmp_path} {args}\n", (forked.stdout, real.stdout)
    assert "raw err" in forked.stderr
    if args == ["raise"]:
        assert "RuntimeError: boom" in forked.stderr and "Traceback" in forked.stderr


def test_a_module_runs_as_with_dash_m():
    proc = run_script("pipetrain.parallel.pipeline.schedules", ["--schedule", "1f1b", "--pp", "2",
                                                                "--microbatches", "2"])
    assert proc.returncode == 0 and "rank " in proc.stdout, proc.stderr


def test_a_script_past_its_timeout_is_killed_and_raises(script):
    with pytest.raises(subprocess.TimeoutExpired) as info:
        run_script(script, ["hang"], timeout=2)
    assert "out None" in info.value.output
