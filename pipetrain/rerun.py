"""Launching a run again: the same recipe into an output directory that holds its checkpoints resumes.

As with torchtitan and Megatron, running the same command twice continues the run instead of failing:
a launch without --resume whose run.output_dir holds checkpoints of the same recipe resumes from the
newest intact one (as --resume auto), and a run whose newest checkpoint already reached train.steps
reports its final metrics and exits 0 without training. "The same recipe" is every key but train.steps
(raise it to train further) and run.* (logging, evaluation cadence, the output directory itself),
compared with the resolved recipe that the newest checkpoint's manifest holds. A different recipe there
is refused with one line naming the keys that differ: resuming it would continue another run.

Every rank decides from the same files before the process group starts, so no collective is needed.
May import: config, checkpoint.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from pipetrain.checkpoint.read import checkpoint_dirs, read_manifest
from pipetrain.config import ConfigError, Recipe

# Keys a rerun may change: train.steps extends (or ends) the run; run.* does not touch the trajectory.
FREE_SECTIONS = ("run",)
FREE_KEYS = (("train", "steps"),)


@dataclass(frozen=True)
class SavedRun:
    """The newest checkpoint of run.output_dir whose manifest reads."""
    ckpt_dir: str
    step: int
    recipe: dict


def newest_saved_run(output_dir: str) -> SavedRun | None:
    """The newest checkpoint with a readable manifest (files are verified when the resume loads them);
    None when checkpoints/ holds no step folder. ConfigError when step folders exist but none reads."""
    problem = None
    for path in checkpoint_dirs(os.path.join(output_dir, "checkpoints"))[::-1]:
        try:
            manifest = read_manifest(path, check_files=False)
            return SavedRun(path, int(manifest["step"]), manifest["recipe"])
        except (ConfigError, OSError, KeyError, TypeError, ValueError) as exc:
            problem = problem or f"{path}: {exc}"
    if problem:
        raise ConfigError(f"run.output_dir={output_dir}: already holds checkpoints, none of them readable, got "
                          f"{problem}; set run.output_dir to a new folder or move the checkpoints away")
    return None


def recipe_differences(saved: dict, now: dict) -> list[str]:
    """`section.key: saved vs now` for every key that differs, train.steps and run.* aside."""
    out = []
    for section in sorted(set(saved) | set(now)):
        if section in FREE_SECTIONS:
            continue
        old, new = saved.get(section) or {}, now.get(section) or {}
        for key in sorted(set(old) | set(new)):
            if (section, key) not in FREE_KEYS and old.get(key) != new.get(key):
                out.append(f"{section}.{key}: {old.get(key)!r} there, {new.get(key)!r} now")
    return out


def rerun_of(recipe: Recipe) -> SavedRun | None:
    """The saved run this launch (without --resume) continues, or None for a fresh run; ConfigError when
    run.output_dir holds another recipe's checkpoints."""
    saved = newest_saved_run(recipe.run.output_dir)
    if saved is None:
        return None
    diffs = recipe_differences(saved.recipe, recipe.to_dict())
    if diffs:
        shown = "; ".join(diffs[:3]) + (f"; and {len(diffs) - 3} more" if len(diffs) > 3 else "")
        raise ConfigError(f"run.output_dir={recipe.run.output_dir}: already holds checkpoints of another recipe, "
                          f"got {shown} (checkpoint {saved.ckpt_dir}); set run.output_dir to a new folder, or pass "
                          "--resume auto to continue that run with this recipe")
    return saved


def finished_report(saved: SavedRun, recipe: Recipe) -> str:
    """What a finished run prints when launched again: its checkpoint and final metrics from metrics.jsonl."""
    last_step = last_eval = None
    path = os.path.join(recipe.run.output_dir, "metrics.jsonl")
    if os.path.isfile(path) and not os.path.islink(path):  # a pipe blocked the read forever; a link leads elsewhere
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError):
                    continue  # a torn last line of a killed run, or a damaged one
                if not isinstance(record, dict) or not isinstance(record.get("step", 0), int) or \
                        record.get("step", 0) > saved.step:
                    continue
                if isinstance(record.get("loss"), (int, float)):
                    last_step = record
                elif isinstance(record.get("eval_loss"), (int, float)):
                    last_eval = record
    line = (f"run.output_dir={recipe.run.output_dir} already finished: its checkpoint {saved.ckpt_dir} is at step "
            f"{saved.step} of train.steps={recipe.train.steps}")
    if last_step is not None:
        line += f"; final loss {last_step['loss']:.4f} at step {last_step['step']}"
    if last_eval is not None:
        line += f", eval loss {last_eval['eval_loss']:.4f} at step {last_eval['step']}"
    return line + ". Nothing to train: raise train.steps to continue it, or set run.output_dir for a new run"
