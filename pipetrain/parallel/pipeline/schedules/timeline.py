"""The timeline command: build, validate and simulate a schedule, then draw it as ASCII (or a PNG).

    python -m pipetrain.parallel.pipeline.schedules --schedule 1f1b --pp 4 --microbatches 8 \\
        [--virtual-stages 2] (--schedule gpipe | 1f1b | interleaved-1f1b | zbv | dualpipev)
        [--cost-f 1 --cost-b 2 --cost-comm 0] [--split-backward [--cost-w 1]] [--png out.png]
"""
from __future__ import annotations

import sys
import warnings
from typing import Sequence

from pipetrain.config import ArgumentParser
from pipetrain.parallel.pipeline.schedules.actions import (B, COMPUTE_KINDS, F, SCHEDULES, V_SCHEDULES, W, Action,
                                                           placement_of)
from pipetrain.parallel.pipeline.schedules.builders import build_all_schedules, schedule_problems
from pipetrain.parallel.pipeline.schedules.timing import SimResult, ideal_bubble, simulate
from pipetrain.parallel.pipeline.schedules.validate import validate_schedule


def _label(a: Action, virtual_stages: int) -> str:
    return f"{a.kind}{a.microbatch}" + (f"c{a.chunk}" if virtual_stages > 1 else "")


def render_timeline(result: SimResult, cols_per_unit: float | None = None) -> str:
    """ASCII timeline: one row per rank; each compute is its label padded with '-' (F), '=' (B) or '~' (W);
    '.' is idle."""
    computes = [(r, i, a) for r, actions in enumerate(result.schedules)
                for i, a in enumerate(actions) if a.kind in COMPUTE_KINDS]
    if not computes:
        return "(empty schedule)"
    if cols_per_unit is None:  # widest label plus one pad character fits in the shortest compute
        shortest = min(result.ends[r][i] - result.starts[r][i] for r, i, _ in computes)
        widest = max(len(_label(a, result.virtual_stages)) for _, _, a in computes)
        cols_per_unit = (widest + 1) / shortest if shortest > 0 else 1.0
    width = round(result.makespan * cols_per_unit)
    rows = []
    for r, actions in enumerate(result.schedules):
        row = ["."] * width
        for i, a in enumerate(actions):
            if a.kind not in COMPUTE_KINDS:
                continue
            lo, hi = round(result.starts[r][i] * cols_per_unit), round(result.ends[r][i] * cols_per_unit)
            text = _label(a, result.virtual_stages)[: hi - lo].ljust(hi - lo, {F: "-", B: "=", W: "~"}[a.kind])
            row[lo:hi] = text
        rows.append(f"rank {r} |{''.join(row)}| idle {result.bubble_per_rank[r]:6.1%}")
    legend = (f"one column = {1 / cols_per_unit:.3g} time units; F<mb>/B<mb>/W<mb> forward/backward/weight grads"
              + (" of chunk c<k>" if result.virtual_stages > 1 else "") + "; '.' idle")
    return "\n".join(rows + [legend])


def write_png(result: SimResult, path: str, title: str = "") -> None:
    """Gantt chart of the compute actions; needs matplotlib, which is optional (ImportError if missing)."""
    # Deferred: matplotlib is a heavy optional dependency that only --png needs.
    import matplotlib
    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    p = len(result.schedules)
    fig, ax = plt.subplots(figsize=(min(30.0, max(6.0, result.makespan * 0.4)), 0.6 * p + 1.2))
    for r, actions in enumerate(result.schedules):
        for i, a in enumerate(actions):
            if a.kind not in COMPUTE_KINDS:
                continue
            start, dur = result.starts[r][i], result.ends[r][i] - result.starts[r][i]
            shade = 0.45 + 0.5 * a.chunk / max(1, result.virtual_stages - 1)  # darker = earlier chunk
            color = {F: (0.2, 0.4 * shade, shade), B: (shade, 0.45 * shade, 0.1), W: (0.2, shade, 0.3)}[a.kind]
            ax.broken_barh([(start, dur)], (r - 0.4, 0.8), facecolors=color, edgecolors="black", linewidth=0.5)
            ax.text(start + dur / 2, r, _label(a, result.virtual_stages), ha="center", va="center", fontsize=7,
                    color="white")
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(f"{title}  bubble {result.bubble:.1%}".strip())
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: build, validate and simulate a schedule; print the ASCII timeline and bubble fraction."""
    ap = ArgumentParser(prog="python -m pipetrain.parallel.pipeline.schedules", description=main.__doc__)
    ap.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    ap.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    ap.add_argument("--microbatches", type=int, required=True, help="microbatches per step")
    ap.add_argument("--virtual-stages", type=int, default=None,
                    help="model chunks per rank (default 2 for interleaved-1f1b, zbv and dualpipev, 1 otherwise)")
    ap.add_argument("--cost-f", type=float, default=1.0, help="forward time of a rank's layers per microbatch")
    ap.add_argument("--cost-b", type=float, default=2.0, help="backward time of a rank's layers per microbatch")
    ap.add_argument("--cost-comm", type=float, default=0.0, help="latency of one p2p transfer")
    ap.add_argument("--split-backward", action="store_true",
                    help="zero-bubble split: B sends the input gradient, W actions do weight gradients later")
    ap.add_argument("--cost-w", type=float, default=None, help="weight-gradient share of --cost-b (default half)")
    ap.add_argument("--cols-per-unit", type=float, default=None, help="timeline horizontal scale")
    ap.add_argument("--png", default=None, help="also write the timeline as a PNG (needs matplotlib)")
    args = ap.parse_args(argv)
    v = args.virtual_stages or (2 if args.schedule in ("interleaved-1f1b",) + V_SCHEDULES else 1)
    placement = placement_of(args.schedule)
    try:
        if not (args.cost_f > 0 and args.cost_b > 0 and args.cost_comm >= 0):
            raise ValueError(f"--cost-f and --cost-b must be > 0 and --cost-comm >= 0, got "
                             f"{args.cost_f:g}, {args.cost_b:g}, {args.cost_comm:g}")
        problems = schedule_problems(args.schedule, args.pp, args.microbatches, v)
        if problems:
            raise ValueError("; ".join(problems))
        # Place receives for the B/F ratio being simulated (see build_all_schedules).
        with warnings.catch_warnings(record=True) as caught:  # printed as one line, not with source
            warnings.simplefilter("always")
            schedules = build_all_schedules(args.schedule, args.pp, args.microbatches, v,
                                            backward_cost=args.cost_b / args.cost_f,
                                            split_backward=args.split_backward)
        for w in caught:
            print(f"warning: {w.message}", file=sys.stderr)
        validate_schedule(schedules, args.pp, args.microbatches, v, placement=placement)
        result = simulate(schedules, args.cost_f, args.cost_b, args.cost_comm, virtual_stages=v, cost_w=args.cost_w,
                          placement=placement)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    title = (f"{args.schedule} pp={args.pp} microbatches={args.microbatches}" + (f" v={v}" if v > 1 else "")
             + (" split backward" if args.split_backward else ""))
    print(f"{title}  costs F={args.cost_f:g} B={args.cost_b:g} comm={args.cost_comm:g}")
    print(render_timeline(result, args.cols_per_unit))
    print(f"makespan {result.makespan:g}; bubble {result.bubble:.1%} "
          f"(uniform-cost formula (p-1)/(v*m+p-1) = {ideal_bubble(args.pp, args.microbatches, v):.1%})")
    print(f"peak in-flight activations per rank: {result.peak_in_flight}; "
          f"validated: deadlock-free under async and rendezvous semantics")
    if args.png:
        try:
            write_png(result, args.png, title)
        except ImportError:
            print("error: --png needs matplotlib, which is not installed (pip install matplotlib); "
                  "the ASCII timeline above has the same content", file=sys.stderr)
            return 2
        print(f"wrote {args.png}")
    return 0

