"""Replica failover with torchft (parallel.fault_tolerance: torchft): replica groups, each its own torchrun, meet
at a torchft lighthouse. With every group live a step is the single-process step (the layout rule); a group
killed by faults.kill_rank / kill_at_step is restarted by torchrun --max-restarts 1 while the survivor keeps
stepping on its own, then heals from the survivor and both end on bitwise equal weights. Bad torchft input
exits 2 with one line."""
import importlib.util
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.common import ROOT, SMALL, TINY, checkpoint_tensors, lighthouse, read_metrics, step_losses
from tests.harness import EXACT_FP32, run_script

needs_torchft = pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                   reason='torchft is not installed: pip install "pipetrain[torchft]"')
HEARTBEAT_S = 1.0  # the lighthouse declares a group dead after this long without a heartbeat (torchft's default: 5)


def _command(out, overrides, nproc=None, launcher_args=()):
    sets = list(SMALL) + [f"run.output_dir={out}"] + list(overrides)
    args = ["--recipe", TINY] + [a for s in sets for a in ("--set", s)]
    script = os.path.join(ROOT, "train.py")
    if nproc is None:
        return [sys.executable, script] + args
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            *launcher_args, script] + args


def _env(env=None) -> dict:
    """This process's environment without the replica-group variables, one thread, plus env."""
    inherited = {k: v for k, v in os.environ.items() if k not in ("REPLICA_GROUP_ID", "TORCHFT_LIGHTHOUSE")}
    return dict(inherited, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))


def _start(cmd, env=None) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(env), cwd=ROOT)


def _finish(proc: subprocess.Popen, timeout=600) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _groups(address, out, overrides, per_group, nproc=1, launcher_args=()):
    """Start one torchrun per replica group; per_group[g] are group g's extra overrides."""
    return [_start(_command(out, list(overrides) + list(extra), nproc, launcher_args),
                   env={"TORCHFT_LIGHTHOUSE": address, "REPLICA_GROUP_ID": str(g)})
            for g, extra in enumerate(per_group)]


def _close(expected, got, tol=EXACT_FP32["rtol"]) -> bool:
    return len(expected) == len(got) and all(abs(a - b) <= tol * abs(b) for a, b in zip(got, expected))


@needs_torchft
def test_a_killed_replica_group_heals_from_the_survivor_which_never_stopped(tmp_path, token_cache):
    """Group 1 is SIGKILLed as step K begins and torchrun restarts it; group 0 (an injected straggler, so that
    it is still training when group 1 is back: a restart takes seconds) steps on alone, then group 1 heals
    from it and both finish on the same weights. Before the kill, with both groups live, every step's loss is
    the single-process run's."""
    K, N = 8, 56
    run = ["train.steps=%d" % N, "run.eval_every=0", f"data.cache_dir={token_cache}"]
    ft = run + ["parallel.fault_tolerance=torchft", "parallel.dp=2"]
    ref = _start(_command(tmp_path / "ref", run))
    with lighthouse(HEARTBEAT_S) as address:
        procs = _groups(address, tmp_path / "ft", ft,
                        [["faults.slow_ranks=[0]", "faults.slow_factor=12"],
                         ["faults.kill_rank=0", f"faults.kill_at_step={K}"]],
                        nproc=1, launcher_args=["--max-restarts=1"])
        survivor, restarted = [_finish(p) for p in procs]
    reference = _finish(ref)
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert survivor.returncode == 0, survivor.stderr[-3000:]
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert f"killing rank 0 at the start of step {K}" in restarted.stderr

    m0 = [m for m in read_metrics(str(tmp_path / "ft" / "replica-0")) if "loss" in m]
    m1 = [m for m in read_metrics(str(tmp_path / "ft" / "replica-1")) if "loss" in m]
    # the survivor committed every step once, in order, some of them alone
    assert [m["step"] for m in m0] == list(range(1, N + 1)), [m["step"] for m in m0]
    live = [m["ft_replicas"] for m in m0]
    assert live[:K - 1] == [2] * (K - 1) and 1 in live[K - 1:] and live[-1] == 2, live
    # both groups live: the layout rule, step by step
    assert _close(step_losses(read_metrics(str(tmp_path / "ref")))[:K - 1], step_losses(m0)[:K - 1])
    # it never stopped for longer than the heartbeat timeout plus one step: the longest it waited on the other
    # group after the kill (for a quorum, then for the exchange), against the slowest step both took together
    # (plus a second for re-forming the cross-group process group on a busy 2-core machine)
    # (a failed attempt of a step is not a line of its own: the redo's line carries its wait)
    waits = [max(m["ft_quorum_s"] + m["ft_wait_s"], m.get("ft_redone_wait_s", 0.0)) for m in m0]
    step = max(m["step_time_s"] for m in m0[1:K - 1])
    assert max(waits[K - 1:]) <= HEARTBEAT_S + step + 1.0, (step, waits)
    # the restarted group healed from the survivor (weights, optimizer, step, data position) and rejoined
    healed = [m for m in m1 if "ft_healed_at" in m]
    assert len(healed) == 1 and "healed from a live replica group at step" in restarted.stdout, restarted.stdout
    at = healed[0]["ft_healed_at"]
    assert K <= at < N and [m["step"] for m in m1] == list(range(at + 1, N + 1))
    assert all(m["ft_replicas"] == 2 for m in m1) and step_losses(m1) == step_losses(m0)[at:]
    a = checkpoint_tensors(tmp_path / "ft" / "replica-0" / "checkpoints" / f"step-{N:08d}")
    b = checkpoint_tensors(tmp_path / "ft" / "replica-1" / "checkpoints" / f"step-{N:08d}")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), "the groups' final weights differ"


@needs_torchft
@pytest.mark.slow
def test_pipelined_replica_groups_match_the_single_process_losses(tmp_path, single_process_run, token_cache):
    """Two replica groups of two pipeline stages each (4 processes, 2 torchruns): the loss of every step is the
    single-process run's, and the two groups end on bitwise equal weights."""
    ft = [f"data.cache_dir={token_cache}", "parallel.fault_tolerance=torchft", "parallel.dp=2", "parallel.pp=2",
          "parallel.microbatches=2"]
    with lighthouse(HEARTBEAT_S) as address:
        procs = [_finish(p) for p in _groups(address, tmp_path, ft, [[], []], nproc=2)]
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    m0, m1 = (read_metrics(str(tmp_path / f"replica-{g}")) for g in (0, 1))
    assert _close(step_losses(single_process_run), step_losses(m0)) and step_losses(m0) == step_losses(m1)
    assert all(m["ft_replicas"] == 2 for m in m0 if "loss" in m)
    a, b = (checkpoint_tensors(tmp_path / f"replica-{g}" / "checkpoints" / "step-00000020") for g in (0, 1))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def _bad(tmp_path, overrides, env):
    cmd = _command(tmp_path, overrides)  # [python, train.py, *args], run by run_script
    proc = run_script(cmd[1], cmd[2:], _env(env), timeout=300)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_bad_torchft_input_exits_2_with_one_line(tmp_path, token_cache):
    # an importable stand-in that fails like a missing package, so this runs whether or not torchft is installed
    hidden = tmp_path / "hidden"
    (hidden / "torchft").mkdir(parents=True)
    (hidden / "torchft" / "__init__.py").write_text("raise ImportError('No module named torchft')\n")
    ft = ["parallel.fault_tolerance=torchft"]
    env = {"TORCHFT_LIGHTHOUSE": "http://localhost:1", "REPLICA_GROUP_ID": "0"}
    cases = [  # (overrides, env, what the one line says); two at a time. The recipe-only refusals
        # (parallel.dp missing, dp_sync, ps_servers, ...) are config checks: tests/unit/test_ft.py
        (ft + ["parallel.dp=1"], dict(env, PYTHONPATH=str(hidden)), ['pip install "pipetrain[torchft]"']),
    ]
    if importlib.util.find_spec("torchft") is not None:  # the launch environment is read once torchft imports
        cases.append((ft + ["parallel.dp=2"], {"TORCHFT_LIGHTHOUSE": "http://localhost:1"},
                      ["REPLICA_GROUP_ID is not set"]))
        cases.append((ft + ["parallel.dp=2"], dict(env, REPLICA_GROUP_ID="2"), ["REPLICA_GROUP_ID: must be"]))
        cases.append((ft + ["parallel.dp=2", "parallel.ft_connect_timeout_s=2", f"data.cache_dir={token_cache}"],
                      dict(env, TORCHFT_LIGHTHOUSE="http://127.0.0.1:9"),  # nothing listens at port 9
                      ["no torchft lighthouse answered at 'http://127.0.0.1:9'", "ft_connect_timeout_s=2"]))
    # the lighthouse case gets as far as the data: prepare it first, so its stderr is the error line alone
    sets = [a for s in list(SMALL) + [f"data.cache_dir={token_cache}"] for a in ("--set", s)]
    assert run_script("pipetrain.data", ["prepare", "--recipe", TINY] + sets,
                      dict(os.environ, OMP_NUM_THREADS="1")).returncode == 0
    with ThreadPoolExecutor(max_workers=2) as pool:
        lines = list(pool.map(lambda i: _bad(tmp_path / f"case{i}", cases[i][0], cases[i][1]), range(len(cases))))
    for (_, _, expected), line in zip(cases, lines):
        assert all(text in line for text in expected), (expected, line)
