"""Fault-tolerance guarantees the default suite did not check, each against an uninterrupted run or the recipe.

A mutation audit of pipetrain/{elastic,faults,stopping,rerun,run_lock}.py, pipetrain/checkpoint/resume.py and
pipetrain/parallel/replicas/failover.py found realistic bugs that the default suite (and its -m slow tests) let
through: the torchft e2e test sums the groups' gradients, so a healed group that reads the wrong slice or keeps a
stale count still ends on equal weights, and the SIGTERM and lock tests run one process per run. Each test here
fails on one of them within seconds:
- healing from a live replica group without its loader position or its token count (the healed group must
  continue as the live group, line for line and bitwise; the same test catches healing without the optimizer
  state, the weights or the step, which only the 60-s torchft e2e run caught);
- a redone (uncommitted) torchft step counting its tokens twice;
- a group resumed from its own checkpoint waiting for every group, as only a fresh run does (and a fresh run
  waiting for one group fewer, caught before only by the e2e run, by timing);
- faults.kill_rank firing on every rank (also: one step late, where the trainer asks one step early);
- a run lock whose release keeps the flock: the next run in the same process is refused;
- the stop guard leaving its own SIGTERM / SIGINT handlers installed, a stop timeout leaving the half-written
  .tmp-step-* folder of an interrupted save, and the ranks not agreeing on a stop that arrives during the last
  step (the rank that was not signalled evaluates alone and waits for the other);
- damage on one rank outranking a refusal on another (load_agreed's outcome order: every rank must stop, not fall
  back), and a damaged checkpoint named by --resume DIR swapped for an older one (only --resume auto falls back);
- a relaunch (pipetrain.rerun) reading the oldest checkpoint instead of the newest;
- an elastic resume between two microbatch counts equally near the saved size taking the larger microbatch
  (more activation memory per rank than the run had).

torchft's Manager is replaced by a stand-in that heals as torchft does (a group joining behind a live group gets
that group's state_dict() handed to its load_state_dict at its quorum); kills come from the recipe's faults
section only.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import types

import pytest
import torch

from pipetrain.checkpoint.read import CorruptCheckpoint
from pipetrain.checkpoint.resume import load_agreed
from pipetrain.config import ConfigError, FaultsConfig, ParallelConfig, Recipe, TrainConfig
from pipetrain.elastic import SavedLayout, elastic_recipe
from pipetrain.faults import Faults
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.replicas import failover
from pipetrain.parallel.replicas.failover import FaultTolerantOptimizer, Replica
from pipetrain.rerun import rerun_of
from pipetrain.run_lock import RunLock
from pipetrain.stopping import STOP_TIMEOUT_EXIT, StopGuard
from tests.harness import ROOT, run_ranks
from tests.unit.common import LLAMA, build_trainer

needs_torchft = pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                   reason='torchft is not installed: pip install "pipetrain[torchft]"')
SAME = ("step", "loss", "lr", "grad_norm", "tokens")  # what a step line says about the trajectory (no timings)


# ---- torchft replica groups in one process ----

class _Work:
    def wait(self):
        return True


class _Manager:
    """torchft's Manager as pipetrain drives it, for groups that exchange nothing (each trains alone on the
    whole batch) and take turns in one process: a group joining (its first quorum) behind the most advanced
    registered group is healed from it (torchft sends that group's state_dict() to this group's
    load_state_dict); `joined` is the number of live groups each quorum sees (the last repeats); commits fail
    on the attempts in `failing`."""
    groups: list = []
    joined: tuple = (1,)
    failing: frozenset = frozenset()

    def __init__(self, *, load_state_dict, state_dict, **_):
        self.load, self.state, self.step, self.quorums, self.attempts = load_state_dict, state_dict, 0, 0, 0
        _Manager.groups.append(self)

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]

    def start_quorum(self) -> None:
        self.quorums += 1
        ahead = max(_Manager.groups, key=lambda m: m.step)
        if self.quorums == 1 and ahead.step > self.step:
            self.load(copy.deepcopy(ahead.state()))  # torchft sends it over HTTP: a copy
            self.step = ahead.step

    def num_participants(self) -> int:
        return self.joined[min(self.quorums, len(self.joined)) - 1]

    def allreduce(self, tensor, reduce_op=None):
        return _Work()

    def should_commit(self) -> bool:
        self.attempts += 1
        committed = self.attempts not in self.failing
        self.step += committed
        return committed

    def shutdown(self, wait=True) -> None:
        pass


@pytest.fixture
def torchft_stand_in(monkeypatch):
    """torchft's Manager and process group replaced by _Manager (a fresh registry per test)."""
    torchft = pytest.importorskip("torchft")
    monkeypatch.setattr(torchft, "Manager", _Manager)
    monkeypatch.setattr(torchft, "ProcessGroupGloo", lambda timeout: None)
    for name, value in (("groups", []), ("joined", (1,)), ("failing", frozenset())):  # a fresh world per test
        monkeypatch.setattr(_Manager, name, value)
    return _Manager


def _group(out, groups: int = 1, steps: int = 6, resume: str | None = None):
    """A replica group (group 0 of `groups`, one process) of the tiny llama run under FaultTolerantOptimizer."""
    os.makedirs(out, exist_ok=True)
    trainer = build_trainer(LLAMA, str(out), steps=steps, resume=resume)
    trainer.optimizer = FaultTolerantOptimizer(trainer.optimizer, trainer.dims, trainer.recipe, Replica(0, groups, 1))
    trainer.optimizer.attach(trainer)
    return trainer


def _saved_state(trainer) -> dict:
    """Everything the trainer's checkpoint holds (weights, optimizer state) by name, and its data position."""
    _, items, extra = trainer.checkpoint_state(trainable_only=False)
    return {"tensors": {name: tensor.clone() for name, tensor, _, _ in items}, **extra}


def _same_trajectory(a: list[dict], b: list[dict]) -> bool:
    return [{k: r[k] for k in SAME} for r in a] == [{k: r[k] for k in SAME} for r in b]


@needs_torchft
def test_a_healed_group_continues_as_the_live_group_it_healed_from_bitwise(tmp_path, torchft_stand_in):
    """The live group trains 3 steps; a group restarted with nothing saved (step 0) heals at its first quorum
    and from then on both take steps 4..6: the same lines (loss: the same batch; lr: the same step; tokens)
    and the same weights, optimizer state and data position, bitwise."""
    live = _group(tmp_path / "live")
    for _ in range(3):
        live.train_step()
    behind = _group(tmp_path / "behind")
    got, want = [], []
    for _ in range(3):
        got.append(behind.train_step())  # its first quorum heals it from the live group at step 3
        want.append(live.train_step())
    assert got[0].get("ft_healed_at") == 3 and [r["step"] for r in got] == [4, 5, 6], got
    assert _same_trajectory(got, want), (got, want)
    a, b = _saved_state(live), _saved_state(behind)
    assert a["data"] == b["data"] and a["tokens"] == b["tokens"]
    assert a["tensors"].keys() == b["tensors"].keys()
    assert all(torch.equal(a["tensors"][k], b["tensors"][k]) for k in a["tensors"]), "weights/moments differ"


@needs_torchft
def test_a_redone_step_counts_its_tokens_once(tmp_path, torchft_stand_in):
    """Step 2's exchange fails twice before it commits: every line (tokens included) is the uninterrupted run's."""
    plain = _group(tmp_path / "plain", steps=3)
    want = [plain.train_step() for _ in range(3)]
    torchft_stand_in.groups.clear()  # another run: nothing to heal from
    torchft_stand_in.failing = frozenset({2, 3})
    redone = _group(tmp_path / "redone", steps=3)
    got = [r for r in (redone.train_step() for _ in range(5)) if r.get("ft_committed") is not False]
    assert [r.get("ft_redone", 0) for r in got] == [0, 2, 0]
    assert _same_trajectory(got, want), (got, want)


@needs_torchft
def test_a_fresh_run_waits_for_every_replica_group_before_its_first_step(tmp_path, torchft_stand_in):
    """Of 3 groups, the second joins at the 2nd quorum and the third at the 4th: the first step is taken with 3."""
    torchft_stand_in.joined = (1, 2, 2, 3)
    trainer = _group(tmp_path / "fresh", groups=3)
    record = trainer.train_step()
    assert record["ft_replicas"] == 3 and torchft_stand_in.groups[0].quorums == 4, record


@needs_torchft
def test_a_group_resumed_from_its_checkpoint_joins_at_once_without_the_others(tmp_path, torchft_stand_in,
                                                                              monkeypatch):
    """A group resumed at step 2 (first attempt) while the other group is gone steps alone; it never waits for
    every group, as a fresh run does (here the wait would end in the join timeout's error)."""
    first = _group(tmp_path / "run", groups=2)
    torchft_stand_in.joined = (2,)
    for _ in range(2):
        first.train_step()
    first.checkpointer.save(first)
    first.checkpointer.wait()
    torchft_stand_in.joined = (1,)
    monkeypatch.setattr(failover, "JOIN_TIMEOUT_S", 0.5)
    resumed = _group(tmp_path / "run", groups=2, resume="auto")
    assert resumed.step == 2
    record = resumed.train_step()
    assert record["step"] == 3 and record["ft_replicas"] == 1


# ---- the faults section ----

class _Killed(Exception):
    pass


def _no_kill(monkeypatch) -> list:
    """os.kill records (pid, signal) and raises _Killed instead of killing the test process."""
    kills = []

    def kill(pid, sig):
        kills.append((pid, sig))
        raise _Killed(sig)
    monkeypatch.setattr(os, "kill", kill)
    return kills


def test_a_kill_fires_on_its_rank_as_its_step_begins_in_the_first_attempt_only(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    _no_kill(monkeypatch)
    cfg = FaultsConfig(kill_rank=1, kill_at_step=4)

    def fired() -> list:
        out = []
        for rank in range(3):
            for step in range(1, 8):
                try:
                    Faults(cfg, rank).maybe_kill(step)
                except _Killed:
                    out.append((rank, step))
        return out
    assert fired() == [(1, 4)]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun's restart trains through
    assert fired() == []


def test_a_run_whose_rank_is_killed_at_step_3_logs_steps_1_and_2(tmp_path, monkeypatch):
    """Through the trainer: the recipe's faults section kills rank 0 as step 3 begins (before it trains)."""
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    kills = _no_kill(monkeypatch)
    trainer = build_trainer(LLAMA, str(tmp_path), steps=5)
    trainer.recipe = dataclasses.replace(trainer.recipe, faults=FaultsConfig(kill_rank=0, kill_at_step=3))
    with pytest.raises(_Killed):
        trainer.fit()
    with open(tmp_path / "metrics.jsonl") as f:
        assert [r["step"] for r in map(json.loads, f) if "loss" in r] == [1, 2]
    assert kills == [(os.getpid(), signal.SIGKILL)]


# ---- one run per output folder ----

def test_a_released_run_lock_lets_the_next_run_in_the_same_process_take_the_folder(tmp_path):
    """Tests and benchmarks call the CLI's run in one process, one run after another: release() must drop the
    flock, not only empty the file. While held, a second lock on the folder is refused."""
    first = RunLock(str(tmp_path)).acquire()
    with pytest.raises(ConfigError, match="is in use by another run"):
        RunLock(str(tmp_path)).acquire()
    first.release()
    second = RunLock(str(tmp_path)).acquire()
    assert json.loads((tmp_path / ".pipetrain.lock").read_text())["pid"] == os.getpid()
    second.release()
    assert (tmp_path / ".pipetrain.lock").read_text() == ""


# ---- SIGTERM ----

def test_the_stop_guard_asks_for_a_stop_and_leaves_the_handlers_it_found():
    trainer = types.SimpleNamespace(stop_requested=False)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    guard = StopGuard(trainer, 60.0, None, rank=1).install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not trainer.stop_requested and time.monotonic() < deadline:
            time.sleep(0.01)  # the watcher thread sets the flag as the signal arrives
    finally:
        guard.uninstall()
    assert trainer.stop_requested
    assert {sig: signal.getsignal(sig) for sig in before} == before


def _stop_during_the_last_step(rank, world_size, out):
    trainer = build_trainer(LLAMA, out, ParallelDims.from_degrees(dp=2), steps=2, val_fraction=0.25)
    step = trainer.train_step

    def train_step():
        record = step()
        if rank == 1 and trainer.step == 2:
            trainer.stop_requested = True  # SIGTERM reached rank 1 only, during the last step
        return record
    trainer.train_step = train_step
    history = trainer.fit()
    assert [r["step"] for r in history] == [1, 2] and trainer.stop_requested, (rank, trainer.stop_requested)


def test_a_sigterm_to_one_rank_during_the_last_step_stops_every_rank_alike(tmp_path):
    """The ranks agree on a stop after every step, the last one too: otherwise the rank that was not signalled
    runs the end-of-run evaluation alone and waits in its collective for the other."""
    run_ranks(2, _stop_during_the_last_step, str(tmp_path), timeout_s=20)


# A rank 0 whose save was cut off by the stop timeout: its step never reaches the boundary
STUCK_SAVE = """
import os, signal, sys, threading, types
from pipetrain.stopping import StopGuard
StopGuard(types.SimpleNamespace(stop_requested=False), 0.3, sys.argv[1], rank=0).install()
os.kill(os.getpid(), signal.SIGTERM)
threading.Event().wait(60)  # a save that does not finish
"""


def test_a_stop_timeout_removes_the_interrupted_save_and_keeps_latest(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step-00000002").mkdir(parents=True)
    (root / ".tmp-step-00000004").mkdir()
    (root / ".tmp-step-00000004" / "rank-00000.safetensors").write_bytes(b"half")
    (root / "latest").write_text("step-00000002\n")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(STUCK_SAVE), str(root)], capture_output=True,
                          text=True, timeout=30, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == STOP_TIMEOUT_EXIT, proc.stderr
    assert "checkpoints/latest still names step-00000002" in proc.stderr
    assert sorted(os.listdir(root)) == ["latest", "step-00000002"]


# ---- resuming ----

def test_an_elastic_resume_between_two_counts_takes_the_smaller_microbatch():
    """Saved: 1 replica x 3 microbatches of 4 sequences (global batch 12). On 2 ranks a replica holds 6 sequences:
    1 microbatch of 6 and 2 of 3 are equally near the saved size; the smaller one keeps activation memory within
    what the run had, the larger would not."""
    recipe = Recipe(model=LLAMA, parallel=ParallelConfig(microbatches=3),
                    train=TrainConfig(global_batch=12, seq_len=16))
    saved = SavedLayout(path="ckpt", dp=1, tp=1, pp=1, microbatches=3, global_batch=12)
    got, note = elastic_recipe(recipe, 2, saved)
    assert (got.parallel.dp, got.parallel.microbatches) == (2, 2), note
    assert "2 microbatch(es) of 3 sequence(s) per replica" in note


def _saved_at_2_and_4(out):
    """A 4-step run that saved at steps 2 and 4; its trainer."""
    trainer = build_trainer(LLAMA, str(out), steps=4)
    for step in range(1, 5):
        trainer.train_step()
        if step % 2 == 0:
            trainer.checkpointer.save(trainer)
            trainer.checkpointer.wait()
    return trainer


def test_a_relaunch_continues_from_the_newest_checkpoint_and_a_finished_run_is_seen_as_finished(tmp_path):
    trainer = _saved_at_2_and_4(tmp_path)
    saved = rerun_of(trainer.recipe)  # the same command again (pipetrain.rerun)
    assert saved is not None and saved.step == 4 and saved.ckpt_dir.endswith("step-00000004"), saved


def test_a_named_damaged_checkpoint_is_refused_and_never_swapped_for_an_older_one(tmp_path):
    """--resume DIR names one checkpoint: damage in it stops the resume (only --resume auto falls back)."""
    _saved_at_2_and_4(tmp_path)
    named = tmp_path / "checkpoints" / "step-00000004"
    with open(named / "rank-00000.safetensors", "r+b") as f:  # the last byte: tensor data, only the hash tells
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte ^ 0xFF]))
    with pytest.raises(CorruptCheckpoint):
        build_trainer(LLAMA, str(tmp_path), steps=6, resume=str(named))
    assert build_trainer(LLAMA, str(tmp_path), steps=6, resume="auto").step == 2


# ---- agreeing on a checkpoint ----

def _refused_here_damaged_there(rank, world_size, out):
    dims = ParallelDims.from_degrees(dp=2)

    def load_one(path):
        if rank == 0:
            raise ConfigError(f"checkpoint {path}: saved by another model")
        raise CorruptCheckpoint(f"checkpoint {path}: rank-00001.safetensors: sha256 mismatch")
    with pytest.raises(ConfigError) as refused:
        load_agreed(os.path.join(out, "checkpoints", "step-00000004"), load_one, dims, auto=True, output_dir=out)
    want = "saved by another model" if rank == 0 else "sha256 mismatch"  # each stops on its own error
    assert want in str(refused.value), str(refused.value)


def test_a_refusal_on_one_rank_outranks_damage_on_another(tmp_path):
    """--resume auto: rank 0 refuses the checkpoint (another model), rank 1 finds a file damaged. A refusal
    stops every rank; only damage alone falls back to an older checkpoint."""
    run_ranks(2, _refused_here_damaged_there, str(tmp_path), timeout_s=30)
