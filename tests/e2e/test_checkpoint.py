"""Checkpoints end to end: bitwise resume, resharding, rotation, integrity, crash and preemption."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from pipetrain.checkpoint.load import find_resumable
from pipetrain.checkpoint.read import iter_full_tensors, read_manifest, verify_files
from pipetrain.checkpoint.tools import consolidate, inspect, main as ckpt_main
from pipetrain.config import ConfigError
from tests.e2e.common import ROOT, SMALL, TINY, checkpoint_tensors, read_metrics, run_train, step_losses, worker_pid
from tests.harness import TP_FP32

CKPT = ["train.steps=6", "checkpoint.every=2", "checkpoint.keep=2", "run.eval_every=0", "parallel.microbatches=2"]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, token_cache):
    """One process, 6 steps, a checkpoint every 2 steps, newest 2 kept."""
    out = tmp_path_factory.mktemp("ckpt-ref")
    proc, metrics = run_train(str(out), CKPT, cache_dir=token_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, metrics


def _resume_copy(src_run, step, dest):
    """A fresh output dir holding only src_run's checkpoint of `step`, as if the run had stopped there."""
    os.makedirs(dest / "checkpoints")
    shutil.copytree(src_run / "checkpoints" / f"step-{step:08d}", dest / "checkpoints" / f"step-{step:08d}")
    return dest


def test_keep_k_rotation_and_latest(reference_run):
    out, _ = reference_run
    names = sorted(n for n in os.listdir(out / "checkpoints") if n.startswith("step-"))
    assert names == ["step-00000004", "step-00000006"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000006"
    manifest = read_manifest(str(out / "checkpoints" / "step-00000006"))
    assert manifest["step"] == 6 and manifest["layout"]["dp"] == 1 and manifest["data"]["samples"] == 48
    assert any(n.startswith("optim/exp_avg/") for n in manifest["tensors"])


def test_resume_is_bitwise_identical(reference_run, tmp_path, token_cache):
    out, metrics = reference_run
    resumed = _resume_copy(out, 4, tmp_path / "resumed")
    proc, got = run_train(str(resumed), CKPT, cache_dir=token_cache, extra_args=["--resume", "auto"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    assert step_losses(got) == step_losses(metrics)[4:]  # exact float equality, steps 5 and 6
    a = checkpoint_tensors(out / "checkpoints" / "step-00000006")
    b = checkpoint_tensors(resumed / "checkpoints" / "step-00000006")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), "final weights/moments differ"


@pytest.mark.parametrize("overrides,nproc", [
    (["parallel.zero=2"], 2),                                                    # one process -> dp2 zero2
    pytest.param(["parallel.zero=3"], 2, marks=pytest.mark.slow),                # one process -> dp2 zero3
    # (zero 3 <-> zero 0 checkpoints in the default run: tests/dist/test_zero3.py)
    pytest.param(["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"], 4,  # -> tp2 x pp2
                 marks=pytest.mark.slow),
])
def test_checkpoint_reshards_into_another_layout(reference_run, tmp_path, token_cache, overrides, nproc):
    out, metrics = reference_run
    resumed = _resume_copy(out, 4, tmp_path / "resharded")
    proc, got = run_train(str(resumed), CKPT + overrides, nproc=nproc, cache_dir=token_cache,
                          extra_args=["--resume", "auto"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for a, b in zip(step_losses(got), step_losses(metrics)[4:], strict=True):
        assert abs(a - b) <= TP_FP32["rtol"] * b
    # and back: the resharded run's checkpoint loads into one process, continuing the same curve
    back = _resume_copy(resumed, 6, tmp_path / "back")
    proc, more = run_train(str(back), CKPT + ["train.steps=7"], cache_dir=token_cache, extra_args=["--resume", "auto"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [m["step"] for m in more if "loss" in m] == [7]


@pytest.mark.slow
def test_3d_layout_resume_is_bitwise_identical(tmp_path, token_cache):
    layout = CKPT + ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.zero=1"]
    proc, full = run_train(str(tmp_path / "a"), layout, nproc=8, cache_dir=token_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = _resume_copy(tmp_path / "a", 4, tmp_path / "b")
    proc, got = run_train(str(resumed), layout, nproc=8, cache_dir=token_cache, extra_args=["--resume", "auto"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert step_losses(got) == step_losses(full)[4:]


@pytest.mark.slow
def test_dp2_tp2_checkpoint_loads_into_pp2(tmp_path, token_cache):
    proc, full = run_train(str(tmp_path / "a"), CKPT + ["parallel.tp=2"], nproc=4, cache_dir=token_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = _resume_copy(tmp_path / "a", 4, tmp_path / "b")
    proc, got = run_train(str(resumed), CKPT + ["parallel.pp=2"], nproc=2, cache_dir=token_cache,
                          extra_args=["--resume", "auto"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for a, b in zip(step_losses(got), step_losses(full)[4:], strict=True):
        assert abs(a - b) <= TP_FP32["rtol"] * b


# ---- integrity ------------------------------------------------------------------------------------

def _damaged_copy(reference_run, tmp_path, damage):
    out, _ = reference_run
    ckpt = tmp_path / "checkpoints" / "step-00000006"
    shutil.copytree(out / "checkpoints" / "step-00000006", ckpt)
    damage(ckpt, next(p for p in ckpt.iterdir() if p.suffix == ".safetensors"))
    return ckpt


def _flip_byte(ckpt, file):
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def _truncate(ckpt, file):
    file.write_bytes(file.read_bytes()[:-1000])


def _newer_format(ckpt, file):
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["format_version"] = 99
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage,message", [
    (_flip_byte, "SHA-256 does not match"),
    (_truncate, "truncated"),
    (lambda ckpt, file: file.unlink(), "is missing"),
    (_newer_format, "format version 99 is newer"),
    (lambda ckpt, file: (ckpt / "manifest.json").write_text("{not json"), "not valid JSON"),
])
def test_damaged_checkpoint_is_reported_with_the_file(reference_run, tmp_path, damage, message):
    ckpt = _damaged_copy(reference_run, tmp_path, damage)
    with pytest.raises(ConfigError, match=message):
        verify_files(str(ckpt), read_manifest(str(ckpt)))


def _retype_manifest(ckpt, file):
    """The issue's silent rounding: a dtype edited to bfloat16 (the checksum is not updated)."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    next(iter(manifest["tensors"].values()))["dtype"] = "bfloat16"
    (ckpt / "manifest.json").write_text(json.dumps(manifest, indent=1))


@pytest.mark.parametrize("damage,message,names", [
    (_flip_byte, "SHA-256 does not match", "rank-00000"),
    pytest.param(_retype_manifest, "manifest checksum does not match", "manifest.json",
                 marks=pytest.mark.slow),  # tests/unit/test_manifest_fuzz.py covers manifest damage by default
])
def test_corrupt_checkpoint_exits_2_and_auto_falls_back(reference_run, tmp_path, token_cache, damage, message,
                                                        names):
    out, _ = reference_run
    ckpt = _damaged_copy(reference_run, tmp_path, damage)
    proc, _ = run_train(str(tmp_path / "x"), CKPT, cache_dir=token_cache, extra_args=["--resume", str(ckpt)])
    assert proc.returncode == 2 and message in proc.stderr and names in proc.stderr
    assert "Traceback" not in proc.stderr
    shutil.copytree(out / "checkpoints" / "step-00000004", tmp_path / "checkpoints" / "step-00000004")
    # rank 0 chooses by manifest, headers and sizes (a flipped byte passes); the hash fails when it is loaded
    expected_choice = "step-00000004" if names == "manifest.json" else "step-00000006"
    assert find_resumable(str(tmp_path)) == str(tmp_path / "checkpoints" / expected_choice)
    proc, metrics = run_train(str(tmp_path), CKPT, cache_dir=token_cache, extra_args=["--resume", "auto"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipping checkpoint" in proc.stderr and "step-00000006" in proc.stderr and message in proc.stderr
    assert f"resumed from {tmp_path / 'checkpoints' / 'step-00000004'} at step 4" in proc.stdout
    assert [m["step"] for m in metrics if "loss" in m] == [5, 6]


def test_checkpoint_of_another_model_is_refused(reference_run, tmp_path, token_cache):
    resumed = _resume_copy(reference_run[0], 4, tmp_path / "other")
    proc, _ = run_train(str(resumed), CKPT + ["model.n_layers=2"], cache_dir=token_cache,
                        extra_args=["--resume", "auto"])
    assert proc.returncode == 2
    assert "model.n_layers: checkpoint 4 vs recipe 2" in proc.stderr


@pytest.mark.parametrize("head_dim", [8, 32], ids=["smaller", "larger"])
def test_checkpoint_whose_tensors_have_other_shapes_is_refused_naming_the_tensor(reference_run, tmp_path,
                                                                                  token_cache, head_dim):
    """model.head_dim (saved 64 / 4 = 16) is not among the keys compared by name: the tensors' own shapes refuse
    it. Smaller: reading the recipe's box would have loaded part of each saved tensor, silently; larger: it was
    called an incomplete checkpoint. Neither run writes a checkpoint over the saved one."""
    resumed = _resume_copy(reference_run[0], 4, tmp_path / "other")
    saved = {f.name: f.read_bytes() for f in (resumed / "checkpoints" / "step-00000004").iterdir()}
    proc, _ = run_train(str(resumed), CKPT + [f"model.head_dim={head_dim}"], cache_dir=token_cache,
                        extra_args=["--resume", "auto"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "layers.0.attn.wq.weight has shape [64, 64] there and " in errors[0], errors
    assert "set the model keys the checkpoint was saved with" in errors[0]
    assert os.listdir(resumed / "checkpoints") == ["step-00000004"]
    assert {f.name: f.read_bytes() for f in (resumed / "checkpoints" / "step-00000004").iterdir()} == saved


# ---- crash and preemption -------------------------------------------------------------------------

def _start(out, overrides, token_cache, nproc=1):
    sets = SMALL + [f"run.output_dir={out}", f"data.cache_dir={token_cache}"] + overrides
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                   f"--nproc-per-node={nproc}"]
    cmd = launch + [os.path.join(ROOT, "train.py"), "--recipe", TINY] + [a for s in sets for a in ("--set", s)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.parametrize("how", [[], pytest.param(["checkpoint.async=true"], marks=pytest.mark.slow)],
                         ids=["sync", "async"])  # async saves by default: tests/unit/test_async_checkpoint.py
def test_kill_during_save_leaves_previous_checkpoint_as_latest(tmp_path, token_cache, how):
    proc = _start(tmp_path, ["train.steps=200", "checkpoint.every=1", "checkpoint.keep=3"] + how, token_cache)
    root = tmp_path / "checkpoints"
    killed_mid_save = False
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        done = [n for n in os.listdir(root) if n.startswith("step-")] if root.exists() else []
        partial = [n for n in os.listdir(root) if n.startswith(".tmp-")] if root.exists() else []
        if done and partial:  # a save is under way and an earlier one is complete: kill now
            proc.send_signal(signal.SIGKILL)
            killed_mid_save = True
            break
        time.sleep(0.0005)
    proc.wait()
    assert killed_mid_save, "never caught a save in progress"
    latest = (root / "latest").read_text().strip()
    assert (root / latest).is_dir() and not latest.startswith(".tmp")
    verify_files(str(root / latest), read_manifest(str(root / latest)))
    step = read_manifest(str(root / latest))["step"]
    proc, metrics = run_train(str(tmp_path), ["train.steps=" + str(step + 1), "checkpoint.every=1"],
                              cache_dir=token_cache, extra_args=["--resume", "auto"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"at step {step}" in proc.stdout
    assert [m["step"] for m in metrics if "loss" in m][-1] == step + 1


def test_sigterm_saves_and_exits_0(tmp_path, token_cache):
    proc = _start(tmp_path, ["train.steps=500"], token_cache)
    deadline = time.time() + 300
    while time.time() < deadline and len(read_metrics(str(tmp_path))) < 2:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()[-3000:]
    latest = (tmp_path / "checkpoints" / "latest").read_text().strip()
    step = read_manifest(str(tmp_path / "checkpoints" / latest))["step"]
    assert 2 <= step < 500 and step == max(m["step"] for m in read_metrics(str(tmp_path)))


def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step(tmp_path, token_cache):
    # A scheduler may signal one process first: the ranks agree on the stop (an all-reduce of the
    # flag), so both save the same step and exit 0 instead of one rank hanging in the next collective.
    proc = _start(tmp_path, ["train.steps=500", "parallel.dp=2"], token_cache, nproc=2)
    deadline = time.time() + 300
    while time.time() < deadline and len(read_metrics(str(tmp_path))) < 2:
        time.sleep(0.2)
    pid = worker_pid(str(tmp_path), 1)
    assert pid is not None, "rank 1's process not found"
    os.kill(pid, signal.SIGTERM)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()[-3000:]
    latest = (tmp_path / "checkpoints" / "latest").read_text().strip()
    manifest = read_manifest(str(tmp_path / "checkpoints" / latest))
    step = manifest["step"]
    assert 2 <= step < 500 and step == max(m["step"] for m in read_metrics(str(tmp_path)))
    verify_files(str(tmp_path / "checkpoints" / latest), manifest)  # both ranks' files, complete
    proc, metrics = run_train(str(tmp_path), ["train.steps=" + str(step + 1), "parallel.dp=2"], nproc=2,
                              cache_dir=token_cache, extra_args=["--resume", "auto"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [m["step"] for m in metrics if "loss" in m][-1] == step + 1


def test_inspect_and_consolidate_without_the_original_world(reference_run, tmp_path):
    ckpt = str(reference_run[0] / "checkpoints" / "step-00000006")
    text = inspect(ckpt)
    assert "step 6" in text and "layout dp=1 tp=1 pp=1 zero=0" in text and "model/embed.weight" in text
    files = consolidate(ckpt, str(tmp_path / "full"), max_shard_bytes=1_000_000)  # forces several shards
    assert len(files) > 1
    index = json.loads((tmp_path / "full" / "model.safetensors.index.json").read_text())
    full = {}
    for f in files:
        full.update(load_file(str(tmp_path / "full" / f)))
    expected = dict(iter_full_tensors(ckpt))
    assert set(index["weight_map"]) == set(full) == set(expected)
    assert all(torch_equal(full[k], expected[k]) for k in expected)


def test_consolidate_refuses_a_file_a_model_folder_and_the_checkpoint_itself(reference_run, tmp_path, capsys):
    ckpt = str(reference_run[0] / "checkpoints" / "step-00000006")
    (tmp_path / "file").write_text("x")
    out = tmp_path / "full"
    big = consolidate(ckpt, str(out), max_shard_bytes=1_000_000)  # sharded: an index and several files
    for target, pattern in ((tmp_path / "file", "is an existing file"), (out, "already holds a model"),
                            (ckpt, "is inside the checkpoint"), (os.path.join(ckpt, "sub"), "is inside the checkpoint")):
        assert ckpt_main(["consolidate", ckpt, str(target)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and pattern in err[0], err
    assert sorted(os.listdir(out)) == sorted(big + ["model.safetensors.index.json", "pipetrain_model.json"])
    # another checkpoint is never a target, --overwrite or not (it deleted that checkpoint's rank files)
    other = tmp_path / "other-step"
    shutil.copytree(reference_run[0] / "checkpoints" / "step-00000004", other)
    kept = {f.name: f.read_bytes() for f in other.iterdir()}
    assert ckpt_main(["consolidate", ckpt, str(other), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a pipetrain checkpoint (it holds manifest.json), which is never overwritten" in err[0]
    assert {f.name: f.read_bytes() for f in other.iterdir()} == kept
    one = consolidate(ckpt, str(out), overwrite=True)  # one file now: no stale shard or index is left
    assert sorted(os.listdir(out)) == sorted(one + ["pipetrain_model.json"]) and len(one) == 1
    # a damaged checkpoint is refused before OUT is touched: the model there (even with --overwrite) stays, and a
    # new folder gets no zero-filled model that would load
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    data = next(p for p in bad.iterdir() if p.suffix == ".safetensors")
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF
    data.write_bytes(bytes(raw))
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    for target, extra in ((out, ["--overwrite"]), (tmp_path / "new", [])):
        assert ckpt_main(["consolidate", str(bad), str(target), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "SHA-256" in err[0], err
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before
    assert not (tmp_path / "new").exists() or not any(f.endswith(".safetensors") for f in os.listdir(tmp_path / "new"))


def torch_equal(a, b):
    return a.shape == b.shape and bool((a == b).all())
