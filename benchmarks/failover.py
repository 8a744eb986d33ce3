"""Time lost per failure: restart-and-resume under torchrun against torchft replica failover (docs/benchmarks.md).

    python benchmarks/failover.py [--rounds 3] [--heartbeat-s 5,1] [--kill-at 6] [--steps 400]

Restart-and-resume is benchmarks/restart.py's round (2 processes, checkpoint every 4 steps, rank 1 killed as
step 6 begins): seconds from the kill to the first step of the restarted attempt, and the steps redone.

Torchft failover: a torchft lighthouse (declaring a group dead after --heartbeat-s without a heartbeat) and
two replica groups of one process each (`parallel.fault_tolerance: torchft`, parallel.dp 2), group 1 under
`torchrun --max-restarts 1` with faults.kill_rank 0 / kill_at_step K. Output lines are stamped with the wall
clock as they arrive, so the kill (group 1's "killing rank" line) lines up with the groups' metrics
(`wall_time` of every step). Reported: the survivor's first step after the kill (seconds after it), its
longest wait on the other group (quorum + exchange), the steps it redid (uncommitted steps) and took alone;
the restarted group's first step (healed from the survivor) after the kill and the steps it redid. The run
is long enough (--steps) that the survivor is still training when the restarted group is back.
Measured on CPU with gloo; a GPU job adds CUDA/NCCL start-up to every restart.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from common import ROOT
from restart import _one as restart_round

from tests.e2e.common import SMALL, lighthouse, read_metrics  # the tiny recipe cut down as the e2e tests run it


def _launch(out: str, address: str, group: int, steps: int, extra: list[str], launcher: list[str]):
    sets = SMALL + ["run.eval_every=0", f"run.output_dir={out}", f"train.steps={steps}",
                    "parallel.fault_tolerance=torchft", "parallel.dp=2"] + extra
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", *launcher,
           os.path.join(ROOT, "train.py"), "--recipe", os.path.join(ROOT, "recipes", "tiny.yaml")]
    cmd += [a for s in sets for a in ("--set", s)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCHFT_LIGHTHOUSE=address,
               REPLICA_GROUP_ID=str(group))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    lines: list[tuple[float, str]] = []

    def pump(stream):
        for line in stream:
            lines.append((time.time(), line.rstrip()))  # wall clock: comparable with the metrics' wall_time

    pumps = [threading.Thread(target=pump, args=(s,), daemon=True) for s in (proc.stdout, proc.stderr)]
    for t in pumps:
        t.start()
    return proc, pumps, lines


def torchft_round(heartbeat_s: float, kill_at: int, steps: int) -> dict:
    out = tempfile.mkdtemp()
    with lighthouse(heartbeat_s) as address:
        runs = [_launch(out, address, 0, steps, [], []),
                _launch(out, address, 1, steps, ["faults.kill_rank=0", f"faults.kill_at_step={kill_at}"],
                        ["--max-restarts=1"])]
        for proc, pumps, lines in runs:
            proc.wait()
            for t in pumps:
                t.join()
            assert proc.returncode == 0, "\n".join(text for _, text in sorted(lines)[-40:])
    t_kill = next(t for t, text in runs[1][2] if "killing rank" in text)
    m0 = [m for m in read_metrics(os.path.join(out, "replica-0")) if "loss" in m]
    m1 = [m for m in read_metrics(os.path.join(out, "replica-1")) if "loss" in m]
    healed = [m for m in m1 if "ft_healed_at" in m]
    assert healed, f"group 1 did not heal: the survivor finished first; raise --steps (log: {out})"
    after = [m for m in m0 if m["wall_time"] > t_kill]
    steps_alone = sum(m["ft_replicas"] == 1 for m in m0)
    return {"survivor_back_s": after[0]["wall_time"] - t_kill,
            "survivor_max_wait_s": max(max(m["ft_quorum_s"] + m["ft_wait_s"], m.get("ft_redone_wait_s", 0.0))
                                       for m in after),
            "survivor_redone": sum(m.get("ft_redone", 0) for m in m0),
            "steps_alone": steps_alone,
            "restarted_back_s": healed[0]["wall_time"] - t_kill,
            "heal_s": healed[0]["ft_quorum_s"],
            "restarted_redone": sum(m.get("ft_redone", 0) for m in m1),
            "normal_step_s": statistics.median(m["step_time_s"] for m in m0[1:kill_at - 1])}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--heartbeat-s", default="5,1", help="lighthouse heartbeat timeouts to measure, comma-separated")
    ap.add_argument("--kill-at", type=int, default=6)
    ap.add_argument("--steps", type=int, default=400, help="torchft run length: the survivor must outlast a restart")
    args = ap.parse_args()
    rows = {"restart": [restart_round(2, args.kill_at, 4, args.kill_at + 2) for _ in range(args.rounds)]}
    for hb in (float(x) for x in args.heartbeat_s.split(",")):
        rows[hb] = [torchft_round(hb, args.kill_at, args.steps) for _ in range(args.rounds)]
    med = lambda runs, key: statistics.median(r[key] for r in runs)  # noqa: E731
    runs = rows.pop("restart")
    print(json.dumps({"restart": runs, **{f"torchft_hb{hb:g}": r for hb, r in rows.items()}}, indent=1))
    print(f"{args.rounds} rounds each, kill at step {args.kill_at}; medians")
    print(f"restart-and-resume: {med(runs, 'kill_to_training_s'):.1f} s from the kill to training again; "
          f"{med(runs, 'steps_lost'):g} step(s) redone")
    for hb, r in rows.items():
        print(f"torchft, heartbeat {hb:g} s: survivor steps again {med(r, 'survivor_back_s'):.2f} s after the kill "
              f"(longest wait on the other group {med(r, 'survivor_max_wait_s'):.2f} s; a step takes "
              f"{med(r, 'normal_step_s'):.3f} s), {med(r, 'survivor_redone'):g} step(s) redone, "
              f"{med(r, 'steps_alone'):g} step(s) alone; restarted group training again "
              f"{med(r, 'restarted_back_s'):.1f} s after the kill (healing {med(r, 'heal_s'):.2f} s), "
              f"{med(r, 'restarted_redone'):g} step(s) redone")


if __name__ == "__main__":
    main()
