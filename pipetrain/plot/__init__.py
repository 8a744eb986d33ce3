"""`python -m pipetrain.plot RUN_DIR [--out FILE]`: loss.png from a run's metrics.jsonl.

Two panels sharing the step axis: train loss per step with eval loss at its evaluation steps, and
the learning rate. matplotlib is an optional extra (pip install -e ".[plot]").
"""
from __future__ import annotations

import json
import math
import os

from pipetrain.config import ConfigError, clip
from pipetrain.folders import refuse_outside


def _number(value) -> bool:
    """A number a figure can place: finite as a float (an integer of 400 digits overflowed in matplotlib)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def read_metrics(run_dir: str) -> tuple[list[dict], list[dict]]:
    """(step records, eval records) of RUN_DIR/metrics.jsonl; a resumed run's repeated steps keep the last."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(f"plot: {path} not found; pass a run folder (run.output_dir) of a run that took a step")
    refuse_outside(run_dir, os.path.realpath(run_dir), path, os.path.realpath(path), "plot",
                   "pass the run folder that holds the metrics file")  # nothing is read from outside the folder
    steps: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                record = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
                why = exc.msg if isinstance(exc, json.JSONDecodeError) else \
                    "nested too deep" if isinstance(exc, RecursionError) else "not UTF-8 text"
                raise ConfigError(f"plot: {path} line {number} is not JSON ({why}); the file is damaged") from None
            kind = "loss" if isinstance(record, dict) and "loss" in record else "eval_loss"
            if not isinstance(record, dict) or kind not in record:
                continue  # a line of another kind (a banner, a tracker's record): nothing to plot
            # lr may be absent (an eval line has none); a line without its step has nowhere to go
            bad = [key for key in ("step", kind, "lr") if not _number(record.get(key, 0.0 if key == "lr" else None))]
            if bad:
                values = ", ".join(f"{key}={clip(repr(record.get(key)))}" for key in bad)
                raise ConfigError(f"plot: {path} line {number} has {values}, not a finite number; the file is damaged")
            (steps if kind == "loss" else evals)[record["step"]] = record
    if not steps and not evals:
        raise ConfigError(f"plot: {path} holds no step or eval records, got an empty file; train a few steps first")
    return [steps[s] for s in sorted(steps)], [evals[s] for s in sorted(evals)]


def plot_run(run_dir: str, out: str | None = None) -> str:
    """Write the loss and learning-rate figure; returns its path (default RUN_DIR/loss.png)."""
    steps, evals = read_metrics(run_dir)
    try:
        import matplotlib  # optional extra: imported only by this command
    except ImportError:
        raise ConfigError('plot: matplotlib is not installed, got ImportError; install the extra with '
                          'pip install -e ".[plot]"') from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    if out is None:
        out = os.path.join(run_dir, "loss.png")
    elif os.path.isdir(out):  # --out a folder: the figure goes inside it, as cp does
        out = os.path.join(out, "loss.png")
    elif not os.path.splitext(out)[1]:  # matplotlib appends the format itself: say the name it writes
        out += ".png"
    fig, (ax_loss, ax_lr) = plt.subplots(2, 1, sharex=True, figsize=(8, 6), height_ratios=(3, 1))
    if steps:
        ax_loss.plot([r["step"] for r in steps], [r["loss"] for r in steps], label="train loss", linewidth=1)
        ax_lr.plot([r["step"] for r in steps], [r.get("lr", float("nan")) for r in steps], color="tab:green")
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title(os.path.basename(os.path.abspath(run_dir)))
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("step")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=120)
    except (OSError, ValueError) as exc:  # a missing folder, a folder in the way, an extension with no format
        why = clip(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        raise ConfigError(f"plot: cannot write {out} ({why}); pass --out a .png (or .pdf, .svg) path in a folder "
                          "that exists") from None
    finally:
        plt.close(fig)
    return out
