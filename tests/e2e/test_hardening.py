"""Hardening end to end: no input makes train.py hang, print a traceback, or resume from wrong state."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

from pipetrain.checkpoint.read import read_manifest, verify_files
from tests.e2e.common import ROOT, SMALL, TINY, run_train

STOP_TIMEOUT_S = 3


def _popen(out, overrides, token_cache):
    sets = SMALL + [f"run.output_dir={out}", f"data.cache_dir={token_cache}"] + overrides
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--recipe", TINY] + [a for s in sets for a in ("--set", s)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))


def _wait_for_start(proc) -> None:
    """Read stdout until the loop starts (the banner's last line is printed inside fit)."""
    for line in proc.stdout:
        if line.startswith("start:"):
            return
    raise AssertionError(f"the run never started: {proc.stderr.read()[-3000:]}")


def test_sigterm_during_a_step_that_cannot_finish_exits_within_the_timeout(tmp_path, token_cache):
    # 512 microbatches per step: a step takes far longer than the timeout on any machine that runs tests
    proc = _popen(tmp_path, ["train.global_batch=4096", "parallel.microbatches=512", "train.steps=3",
                             "checkpoint.every=1", f"run.stop_timeout_s={STOP_TIMEOUT_S}"], token_cache)
    _wait_for_start(proc)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=STOP_TIMEOUT_S + 30)  # the bound; a timeout here is the failure
    err = proc.stderr.read()
    assert code == 143, err[-3000:]
    assert "did not reach a step boundary and save within run.stop_timeout_s=3" in err and "Traceback" not in err
    assert not (tmp_path / "checkpoints").exists() or not [n for n in os.listdir(tmp_path / "checkpoints")
                                                           if n.startswith(".tmp-")]


def test_second_sigterm_exits_at_once(tmp_path, token_cache):
    proc = _popen(tmp_path, ["train.global_batch=4096", "parallel.microbatches=512", "train.steps=3",
                             "run.stop_timeout_s=600"], token_cache)
    _wait_for_start(proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1)  # two signals sent back to back can merge into one pending signal
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=30)
    err = proc.stderr.read()
    assert code == 143 and "second SIGTERM" in err and "Traceback" not in err, err[-3000:]


# train.py whose checkpoint writer runs out of space halfway through the second save's file, as a full
# disk fails a write: injected in the child process, so the test runs wherever tests run (mounting a
# small tmpfs needs privileges most machines do not grant)
FULL_DISK_AT_SECOND_SAVE = """
import errno, os, sys
import pipetrain.checkpoint.writer as writer
from pipetrain.cli import main

real_save_file = writer.save_file
saves = []

def save_file(tensors, path, metadata=None):
    saves.append(path)
    real_save_file(tensors, path, metadata=metadata)
    if len(saves) >= 2:  # half the file reached the disk, then no space was left
        os.truncate(path, os.path.getsize(path) // 2)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

writer.save_file = save_file
sys.exit(main(sys.argv[1:]))
"""


def test_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, token_cache):
    out = tmp_path / "run"
    sets = SMALL + [f"run.output_dir={out}", f"data.cache_dir={token_cache}", "train.steps=3", "checkpoint.every=1",
                    "checkpoint.keep=1", "run.eval_every=0"]
    cmd = [sys.executable, "-c", FULL_DISK_AT_SECOND_SAVE, "--recipe", TINY] + [a for s in sets for a in ("--set", s)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    root = out / "checkpoints"
    failed_file = root / ".tmp-step-00000002" / "rank-00000.safetensors"
    assert f"checkpoint save failed writing {failed_file}: No space left on device" in errors[0], errors[0]
    assert "MB free" in errors[0] and "previous checkpoint stays latest" in errors[0]
    assert (root / "latest").read_text().strip() == "step-00000001"
    assert sorted(os.listdir(root)) == ["latest", "step-00000001"]  # the half-written .tmp-* folder is gone
    verify_files(str(root / "step-00000001"), read_manifest(str(root / "step-00000001")))
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]  # it stopped at the failed save


def test_a_second_run_on_the_same_output_dir_is_refused(tmp_path, token_cache):
    first = _popen(tmp_path, ["train.steps=500"], token_cache)
    try:
        _wait_for_start(first)
        proc, _ = run_train(str(tmp_path), ["train.steps=500"], cache_dir=token_cache, timeout=120)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "is in use by another run" in proc.stderr and f"pid {first.pid}" in proc.stderr
        assert "Traceback" not in proc.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=120) == 0, first.stderr.read()[-3000:]


def test_a_stale_lock_is_reported_and_taken_over(tmp_path, token_cache):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is (almost surely) free now
    (tmp_path / ".pipetrain.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid}))
    proc, metrics = run_train(str(tmp_path), ["train.steps=1", "run.eval_every=0"], cache_dir=token_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "taking over a stale lock" in proc.stderr and f"pid {dead.pid}" in proc.stderr
    assert (tmp_path / ".pipetrain.lock").read_text() == ""  # released on exit


def _refused(tmp_path, token_cache, overrides, out=None):
    """train.py exits 2 with one `error:` line and no traceback; returns that line."""
    proc, _ = run_train(str(out or tmp_path / "run"), overrides, cache_dir=token_cache, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


def test_a_model_that_cannot_fit_is_refused_before_allocating(tmp_path, token_cache):
    line = _refused(tmp_path, token_cache, ["model.d_model=10000000"])
    assert "model.d_model=10000000" in line and "GB is available" in line


def test_a_batch_that_cannot_fit_is_refused(tmp_path, token_cache):
    line = _refused(tmp_path, token_cache, ["train.global_batch=1000000000000"])
    assert "train.global_batch=1000000000000" in line


def test_a_batch_the_corpus_cannot_supply_is_refused(tmp_path, token_cache):
    # 8 sequences per microbatch (fits easily), but more sequences per step than the corpus has windows
    line = _refused(tmp_path, token_cache, ["train.global_batch=65536", "parallel.microbatches=8192"])
    assert "train.global_batch=65536 needs 65,536 training windows" in line


def test_a_non_utf8_text_file_is_refused(tmp_path, token_cache):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\u00e9 cr\u00e8me\n".encode("latin-1") * 100)
    line = _refused(tmp_path, token_cache, [f"data.path={bad}"])
    assert str(bad) in line and "is not UTF-8 text" in line


def test_an_output_dir_that_cannot_be_created_is_refused(tmp_path, token_cache):
    (tmp_path / "file").write_text("")
    line = _refused(tmp_path, token_cache, [], out=tmp_path / "file" / "run")
    assert "cannot be created" in line


def test_a_stray_file_where_a_checkpoint_goes_is_refused(tmp_path, token_cache):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step-00000002").write_text("not a checkpoint")
    line = _refused(tmp_path, token_cache, ["train.steps=2", "checkpoint.every=2"], out=tmp_path / "run")
    assert "step-00000002 is a file where a checkpoint folder would go" in line
