"""python -m pipetrain.plan --recipe R --nproc N [--nodes K] [--device NAME_OR_FILE | --calibrate [--out F]]
                           [--top 10] [--json] [--set k=v ...]

Ranked layouts for R on N processes per node x K nodes: per-rank peak memory by kind, predicted step time by
part and tokens/s, and counts of the rejected layouts by reason. Parallel keys given with --set are held
fixed (semi-auto), as are the recipe's keys when it sets parallel.auto. --calibrate measures this machine,
writes the profile (default plan-profile.json) and plans with it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from pipetrain.config import ArgumentParser, ConfigError, load_recipe
from pipetrain.parallel.mesh.rules import parallel_problems
from pipetrain.plan import format_plan_row, plan_header
from pipetrain.plan.auto import fixed_parallel_keys
from pipetrain.plan.calibrate import calibrate, save_profile
from pipetrain.plan.devices import load_profile
from pipetrain.plan.precision import triton_path
from pipetrain.plan.search import nothing_fits, refused_by_rules, search, world_problem


def parse_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m pipetrain.plan", description=__doc__.split("\n\n")[1])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--nproc", type=int, required=True, help="processes (devices) per node")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="a device name (h100-sxm-80gb, a100-80gb, ...) or a "
                        "profile JSON from --calibrate")
    parser.add_argument("--calibrate", action="store_true", help="measure this machine first")
    parser.add_argument("--out", default="plan-profile.json", help="where --calibrate writes the profile")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    return parser.parse_args(argv)


def _check_writable_file(path: str) -> None:
    """ConfigError unless path can be written as a file: not a folder or a pipe (whose write waited forever for a
    reader, after the minute of measuring), in a folder that exists."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        what = "is a folder"
    elif os.path.exists(path) and not os.path.isfile(path):
        what = "is not a regular file (a pipe, a socket or a device)"
    elif not os.path.isdir(folder):
        what = f"no folder {folder}"
    else:
        return
    raise ConfigError(f"--out {path}: {what}; pass the path of the profile file to write, e.g. plan-profile.json")


def run(args: argparse.Namespace) -> int:
    if args.nproc < 1 or args.nodes < 1:
        raise ConfigError(f"--nproc/--nodes: must be >= 1, got {args.nproc}/{args.nodes}; pass positive counts")
    if args.top < 1:
        raise ConfigError(f"--top: must be >= 1 (how many layouts to list), got {args.top}")
    triton_path("cuda")  # reads PIPETRAIN_KERNELS: an unknown mode is refused as such, not in every candidate
    recipe = load_recipe(args.recipe, args.set, rules=parallel_problems)
    if args.calibrate:  # the profile's file is checked before the measurement (about a minute), not after it
        _check_writable_file(args.out)
        profile = calibrate(recipe=recipe)
        save_profile(profile, args.out)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        profile = load_profile(args.device)
    world = args.nproc * args.nodes
    problem = world_problem(recipe, world, profile.memory_bytes)
    if problem:
        raise ConfigError(f"--nproc {args.nproc} x --nodes {args.nodes}: {problem}")
    fixed = fixed_parallel_keys(args.recipe, args.set) if recipe.parallel.auto else \
        fixed_parallel_keys(None, args.set)
    result = search(recipe, world, profile, fixed, ranks_per_node=args.nproc)
    refused = None if result.plans else refused_by_rules(result, world, fixed)
    if refused:  # bad input (exit 2), where "nothing fits" (exit 1) would blame memory
        raise ConfigError(refused)
    if args.json:
        json.dump({"world_size": world, "device": profile.as_dict(), "fixed": fixed,
                   "plans": [p.as_dict() for p in result.plans[:args.top]],
                   "num_valid": len(result.plans), "rejected": result.reasons(),
                   "rejected_examples": [{"layout": l, "reason": r} for l, r in result.rejected[:args.top]]},
                  sys.stdout, indent=1)
        print()
        return 0
    print(f"{len(result.plans)} layouts fit on {world} x {profile.name} "
          f"({profile.memory_bytes / 2**30:.1f} GiB each); top {min(args.top, len(result.plans))}:")
    if not result.plans:
        print(nothing_fits(recipe, world, profile, fixed))
        return 1
    print(plan_header())
    for i, plan in enumerate(result.plans[:args.top]):
        print(format_plan_row(i + 1, plan))
    reasons = ", ".join(f"{n} {kind}" for kind, n in sorted(result.reasons().items()))
    print(f"rejected: {reasons or 'none'}")
    for layout, reason in result.rejected[:3]:
        print(f"  e.g. tp={layout['tp']} pp={layout['pp']} mb={layout['microbatches']}: {reason}")
    return 0


def main(argv=None) -> int:
    try:
        return run(parse_args(argv))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
