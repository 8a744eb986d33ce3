"""Time lost per failure with restart-and-resume under torchrun (docs/benchmarks.md).

    python benchmarks/restart.py [--rounds 3] [--nproc 2] [--kill-at 6] [--every 4]

The tiny recipe (cut to a 4-layer, 64-wide model, as the e2e tests do) runs under
`torchrun --max-restarts 1` with faults.kill_rank 1 / kill_at_step K and a checkpoint every E steps.
Lines are timestamped as they arrive: from rank 1's "killing rank" line to the first step line of the
restarted attempt is the time from the kill to training again (the agent noticing the death, stopping
the survivors, starting new workers, imports, process group, resume, one step); the steps lost are what
the restarted attempt says it redoes. The median over rounds is quoted. Measured on CPU with gloo; a GPU job adds CUDA/NCCL start-up to the restart.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from common import ROOT

from tests.e2e.common import SMALL  # the tiny recipe cut down as the e2e tests run it


def _one(nproc: int, kill_at: int, every: int, steps: int) -> dict:
    out = tempfile.mkdtemp()
    sets = SMALL + ["run.eval_every=0", f"run.output_dir={out}", f"train.steps={steps}", f"checkpoint.every={every}",
                    "faults.kill_rank=1", f"faults.kill_at_step={kill_at}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--max-restarts=1", os.path.join(ROOT, "train.py"), "--recipe", os.path.join(ROOT, "recipes", "tiny.yaml")]
    cmd += [a for s in sets for a in ("--set", s)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    lines: list[tuple[float, str]] = []

    def pump(stream):
        for line in stream:
            lines.append((time.perf_counter(), line.rstrip()))

    pumps = [threading.Thread(target=pump, args=(s,)) for s in (proc.stdout, proc.stderr)]
    for t in pumps:
        t.start()
    proc.wait()
    for t in pumps:
        t.join()
    assert proc.returncode == 0, "\n".join(text for _, text in lines[-40:])
    lines.sort()
    t_kill = next(t for t, text in lines if "killing rank" in text)
    restarted = next(i for i, (_, text) in enumerate(lines) if "torchrun restart 1" in text)
    t_back = next(t for t, text in lines[restarted:] if re.match(r"step \d+/", text))
    lost = int(re.search(r"(\d+) logged step\(s\) after it are lost", "\n".join(t for _, t in lines))[1])
    return {"kill_to_training_s": t_back - t_kill, "steps_lost": lost}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--kill-at", type=int, default=6)
    ap.add_argument("--every", type=int, default=4)
    args = ap.parse_args()
    runs = [_one(args.nproc, args.kill_at, args.every, args.kill_at + 2) for _ in range(args.rounds)]
    seconds = statistics.median(r["kill_to_training_s"] for r in runs)
    lost = statistics.median(r["steps_lost"] for r in runs)
    print(f"{args.nproc} processes, checkpoint every {args.every}, kill at step {args.kill_at}, {args.rounds} rounds")
    print(f"restart-and-resume: {seconds:.1f} s from the kill to the first step of the restarted attempt "
          f"(median; rounds {[round(r['kill_to_training_s'], 1) for r in runs]}); {lost:g} step(s) redone")


if __name__ == "__main__":
    main()
