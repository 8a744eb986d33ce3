"""Step time of train.py at two commits, measured in one run: did a change cost speed?

    python benchmarks/step_time_ab.py --ref 7803dd2 [--rounds 3] [--steps 8] [--layouts single,pp2,tp2]
    python benchmarks/step_time_ab.py --ref 7803dd2 --first-step [--rounds 3]
    python benchmarks/step_time_ab.py --ref 7803dd2 --profile [--layouts pp2]

The reference commit is checked out into a temporary git worktree; both trees run the same
command (the tiny recipe, one process, or torchrun with 2 processes at pp 2 / tp 2), alternating
round by round so machine noise hits both alike. Each run's step time is the median of
`step_time_s` in its metrics.jsonl after the first two steps; the figure quoted is the median over
rounds, and the ratio is new / ref (below 1 is faster).

--first-step: seconds from launching the tiny recipe (one process) to its first step line in
metrics.jsonl, cold (an empty data cache: the corpus is tokenised / prepared in that launch) and warm
(the same cache again), per tree.

--profile: one run per tree and layout under cProfile (every rank), then the pipetrain functions whose
calls per training step differ between the trees, and the largest own-time differences: a per-call
cost shows up as a count that grows with the steps, whatever the machine's noise does to the clock.
"""
from __future__ import annotations

import argparse
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = "recipes/tiny.yaml"
LAYOUTS = {  # name: (processes, --set overrides)
    "single": (1, []),
    "pp2": (2, ["parallel.pp=2", "parallel.microbatches=4"]),
    "tp2": (2, ["parallel.tp=2"]),
    "bf16": (1, ["train.precision=bf16"]),  # autocast: meaningful where the CPU has bf16 matmuls (avx512_bf16, AMX)
}


def _checkout(rev: str, where: str) -> str:
    """A detached worktree of rev. The venv's editable install maps pipetrain.kernels to this
    checkout's kernels/; a link inside the reference tree makes it import its own kernels instead."""
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-f", where, rev], check=True,
                   capture_output=True)
    os.symlink(os.path.join(where, "kernels"), os.path.join(where, "pipetrain", "kernels"))
    return where


def _run(tree: str, layout: str, steps: int, out: str, cache: str, profile_dir: str | None = None) -> float:
    nproc, sets = LAYOUTS[layout]
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  f"--nproc-per-node={nproc}"]
    if profile_dir is not None:  # every rank under cProfile (profile_rank.py lives in this tree, not ref's)
        os.makedirs(profile_dir, exist_ok=True)
        launch += [os.path.join(ROOT, "benchmarks", "profile_rank.py"), profile_dir]
    args = ["--recipe", os.path.join(tree, RECIPE), "--set", f"train.steps={steps}", "--set", f"run.output_dir={out}",
            "--set", "run.sample_tokens=0", "--set", "run.eval_every=0", "--set", "run.eval_batches=1",
            "--set", "run.progress=false", "--set", "run.log_every=1", "--set", f"data.cache_dir={cache}"]
    for s in sets:
        args += ["--set", s]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, 2 // nproc)), PYTHONPATH=tree)
    proc = subprocess.run(launch + [os.path.join(tree, "train.py")] + args, cwd=tree, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{tree} {layout} failed:\n{proc.stderr[-2000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        times = [r["step_time_s"] for r in map(json.loads, f) if "step_time_s" in r]
    return statistics.median(times[2:])


def _first_step(tree: str, out: str, cache: str) -> float:
    """Seconds from launch to the first step record in metrics.jsonl (the run is then stopped)."""
    args = ["--recipe", os.path.join(tree, RECIPE), "--set", "train.steps=3", "--set", f"run.output_dir={out}",
            "--set", "run.eval_every=0", "--set", "run.progress=false", "--set", f"data.cache_dir={cache}"]
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=tree)
    metrics = os.path.join(out, "metrics.jsonl")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, os.path.join(tree, "train.py")] + args, cwd=tree, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while proc.poll() is None:
            if os.path.exists(metrics) and any('"step"' in line and '"loss"' in line for line in open(metrics)):
                return time.perf_counter() - t0
            time.sleep(0.05)
        raise SystemExit(f"{tree} ended before a first step:\n{proc.stderr.read()[-2000:]}")
    finally:
        proc.kill()
        proc.wait()


def first_step_main(ref_rev: str, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ref = _checkout(ref_rev, os.path.join(tmp, "ref"))
        trees = {"ref": ref, "new": ROOT}
        times = {(name, kind): [] for name in trees for kind in ("cold", "warm")}
        try:
            for rnd in range(rounds):
                for name, tree in trees.items():
                    cache = os.path.join(tmp, f"cache-{name}-{rnd}")
                    for kind in ("cold", "warm"):
                        out = os.path.join(tmp, f"{name}-{kind}-{rnd}")
                        times[name, kind].append(_first_step(tree, out, cache))
                        print(f"round {rnd} {name} {kind}: {times[name, kind][-1]:.2f} s", flush=True)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", ref], capture_output=True)
    print(f"\n| data cache | ref {ref_rev} s | new s | new / ref |\n|---|---|---|---|")
    for kind in ("cold", "warm"):
        r, n = statistics.median(times["ref", kind]), statistics.median(times["new", kind])
        print(f"| {kind} | {r:.2f} | {n:.2f} | {n / r:.3f} |")


def _pipetrain_calls(profile_dir: str, tree: str) -> dict[tuple[str, str], tuple[int, float]]:
    """(file inside the tree, function) -> (calls, own seconds) summed over ranks, pipetrain code only."""
    out = {}
    for name in sorted(os.listdir(profile_dir)):
        for (file, _, func), (_, calls, own, _, _) in pstats.Stats(os.path.join(profile_dir, name)).stats.items():
            if file.startswith(tree) and "site-packages" not in file:  # the tree's code, not a venv inside it
                key = (os.path.relpath(os.path.realpath(file), os.path.realpath(tree)), func)
                n, t = out.get(key, (0, 0.0))
                out[key] = (n + calls, t + own)
    return out


def profile_main(ref_rev: str, layouts: list[str], steps: int) -> None:
    """Calls per step of pipetrain functions, ref against new, from one profiled run of each."""
    with tempfile.TemporaryDirectory() as tmp:
        ref = _checkout(ref_rev, os.path.join(tmp, "ref"))
        try:
            for lay in layouts:
                got = {}
                for name, tree in (("ref", ref), ("new", ROOT)):
                    prof = os.path.join(tmp, f"prof-{name}-{lay}")
                    _run(tree, lay, steps, os.path.join(tmp, f"{name}-{lay}"), os.path.join(tmp, f"cache-{name}"), prof)
                    got[name] = _pipetrain_calls(prof, tree)
                keys = set(got["ref"]) | set(got["new"])
                calls = {k: (got["ref"].get(k, (0, 0))[0], got["new"].get(k, (0, 0))[0]) for k in keys}
                print(f"\n{lay}: pipetrain functions whose call count differs (all ranks, {steps} steps + start-up)")
                for k in sorted(keys, key=lambda k: -abs(calls[k][1] - calls[k][0]))[:15]:
                    if calls[k][0] != calls[k][1]:
                        print(f"  {calls[k][0]:>8} -> {calls[k][1]:>8}  {k[0]}:{k[1]}")
                own = {k: got["new"].get(k, (0, 0.0))[1] - got["ref"].get(k, (0, 0.0))[1] for k in keys}
                print(f"{lay}: largest own-time differences, new - ref (s, profiled)")
                for k in sorted(keys, key=lambda k: -abs(own[k]))[:10]:
                    print(f"  {own[k]:+8.3f}  {k[0]}:{k[1]}")
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", ref], capture_output=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", required=True, help="the commit to compare with (e.g. the one before a change)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layouts", default="single,pp2,tp2")
    ap.add_argument("--first-step", action="store_true", help="time from launch to the first step, cold and warm")
    ap.add_argument("--profile", action="store_true", help="pipetrain calls per step under cProfile, ref vs new")
    a = ap.parse_args()
    if a.first_step:
        return first_step_main(a.ref, a.rounds)
    if a.profile:
        return profile_main(a.ref, a.layouts.split(","), a.steps)
    layouts = a.layouts.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        ref = _checkout(a.ref, os.path.join(tmp, "ref"))
        trees = {"ref": ref, "new": ROOT}
        times = {(name, lay): [] for name in trees for lay in layouts}
        try:
            for rnd in range(a.rounds):
                for lay in layouts:
                    for name, tree in trees.items():
                        out = os.path.join(tmp, f"{name}-{lay}-{rnd}")
                        times[name, lay].append(_run(tree, lay, a.steps, out, os.path.join(tmp, f"cache-{name}")))
                        print(f"round {rnd} {lay:6s} {name}: {times[name, lay][-1]:.3f} s/step", flush=True)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", ref], capture_output=True)
    print(f"\n| layout | ref {a.ref} s/step | new s/step | new / ref |\n|---|---|---|---|")
    for lay in layouts:
        r, n = statistics.median(times["ref", lay]), statistics.median(times["new", lay])
        print(f"| {lay} | {r:.3f} | {n:.3f} | {n / r:.3f} |")


if __name__ == "__main__":
    main()
