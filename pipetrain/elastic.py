"""Elastic resume: a run resumed on a world its recipe's layout does not cover, or on another number of
processes than its checkpoint was saved with.

torchrun restarts a failed worker group, sometimes with fewer or more processes (`--nnodes MIN:MAX` with a node
that did not come back or a new one that joined), and a user may resume by hand on another world. The layout is
then re-derived for the new world:
- tp and pp are kept (they are the recipe's; a world they do not divide is refused with the fix);
- dp becomes world / (tp * pp), even where the recipe pins parallel.dp: that pin described the first world
  (and a second failure on the shrunk world re-derives the same layout again);
- the microbatch size (sequences per microbatch and replica) of the checkpoint's layout is kept, so the
  number of microbatches per replica adjusts and per-rank activation memory stays what it was; when the new
  layout refuses that count (a schedule's minimum), the nearest count it accepts is taken;
- the global batch never changes.
The checkpoint loads into the new layout (it loads into any), and by the layout rule the bsp loss curve
continues as if the world had not changed. The relaxed modes (dp_sync) continue their own mathematics over the
new number of replicas. With parallel.auto the planner re-plans for the new world instead, with parallel.dp
left free (pipetrain.plan.auto).

Only the manifest of the checkpoint is read here (its own checksum, not the tensor files, which may be GBs and
are hashed when loaded). For --resume auto that is the newest checkpoint whose manifest reads; if its files
then fail their hashes the resume falls back to an older checkpoint, whose layout can differ only in the
microbatch size kept, never in the mathematics.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from pipetrain.checkpoint.load import check_resume_dir
from pipetrain.checkpoint.read import checkpoint_dirs, read_manifest
from pipetrain.config import ConfigError, Recipe
from pipetrain.parallel.mesh.rules import layout_problems, mesh_problems, resolve_dp
from pipetrain.plan.auto import resolve_at_launch


@dataclass(frozen=True)
class SavedLayout:
    """The layout a checkpoint was saved with (mesh ranks: parameter servers not counted)."""
    path: str
    dp: int
    tp: int
    pp: int
    microbatches: int
    global_batch: int
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def micro_size(self) -> int:
        """Sequences per microbatch and replica."""
        return max(1, self.global_batch // (self.dp * self.microbatches))


def saved_layout(output_dir: str, resume: str | None) -> SavedLayout | None:
    """The layout of the checkpoint `--resume auto|DIR` will load; None when nothing will be resumed or no
    manifest reads (the resume reports that itself). ConfigError when --resume names no folder."""
    if resume is None:
        return None
    if resume != "auto":
        check_resume_dir(resume)
        candidates = [resume]
    else:
        candidates = checkpoint_dirs(os.path.join(output_dir, "checkpoints"))[::-1]
    for path in candidates:
        try:
            return _layout_of(path, read_manifest(path, check_files=False))
        except (ConfigError, OSError, KeyError, TypeError, ValueError):
            continue  # a manifest that does not read is reported (and skipped) by the resume itself
    return None


def _layout_of(path: str, manifest: dict) -> SavedLayout:
    layout, saved = manifest["layout"], manifest["recipe"]
    dp = layout["dp"]
    if saved["parallel"].get("fault_tolerance") == "torchft":  # a replica group's own dp; the batch is the run's
        dp = saved["parallel"]["dp"]
    values = dict(dp=dp, tp=layout["tp"], pp=layout["pp"], cp=layout.get("cp", 1),
                  microbatches=saved["parallel"]["microbatches"],
                  global_batch=saved["train"]["global_batch"])
    if not all(isinstance(v, int) and v >= 1 for v in values.values()):
        raise ValueError(f"{path}: layout values {values} are not positive integers")
    return SavedLayout(path=path, **values)


def is_elastic(recipe: Recipe, saved: SavedLayout | None, world_size: int) -> bool:
    """True when a resume brings the checkpoint onto a world of another size than it was saved on, or onto a
    world the recipe's (pinned) dp x tp x pp does not cover."""
    if saved is None:
        return False
    p = recipe.parallel
    return saved.world_size != world_size or resolve_dp(recipe, world_size) * p.tp * p.pp * p.cp != world_size


def elastic_recipe(recipe: Recipe, world_size: int, saved: SavedLayout | None) -> tuple[Recipe, str | None]:
    """recipe re-laid for world_size mesh ranks on an elastic resume, and the line saying so; (recipe, None)
    when the resume is not elastic. ConfigError when the world cannot hold tp x pp or split the batch."""
    if not is_elastic(recipe, saved, world_size):
        return recipe, None
    p, t = recipe.parallel, recipe.train
    saved_cp = f" x cp {saved.cp}" if saved.cp > 1 else ""
    before = (f"{saved.path} was saved on {saved.world_size} rank(s) (dp {saved.dp} x tp {saved.tp} x pp "
              f"{saved.pp}{saved_cp}, {saved.microbatches} microbatch(es) of {saved.micro_size} sequence(s) per replica)")
    follows = _with(recipe, None, 1)  # dp follows the world: the mesh's own rules say whether it can
    problems = mesh_problems(follows, world_size)
    if problems:
        raise ConfigError(f"elastic resume: {before}; {problems[0]} (tp and pp are kept)")
    dp = resolve_dp(follows, world_size)
    per_replica = t.global_batch // dp
    counts = [c for c in range(1, per_replica + 1) if per_replica % c == 0]
    want = per_replica / saved.micro_size  # the saved size first, then the nearest counts (ties: more of them)
    counts.sort(key=lambda c: (abs(c - want), -c))
    candidates = [_with(recipe, dp, c) for c in counts]
    chosen = next((r for r in candidates if not layout_problems(r, world_size)), candidates[0])
    m = chosen.parallel.microbatches
    cp = f" x cp {p.cp}" if p.cp > 1 else ""
    note = (f"elastic resume: {before}; on {world_size} rank(s): dp {dp} x tp {p.tp} x pp {p.pp}{cp}, {m} "
            f"microbatch(es) of {per_replica // m} sequence(s) per replica; global batch {t.global_batch} unchanged")
    if chosen.parallel.dp_shard != p.dp_shard:
        note += f"; parallel.dp_shard={p.dp_shard} does not divide dp {dp}: its default is used"
    return chosen, note


def launch_layout(recipe: Recipe, recipe_path: str, overrides, world_size: int, rank: int,
                  resume: str | None) -> tuple[Recipe, str | None]:
    """The launch's layout and, on an elastic resume, the line saying what changed: parallel.auto's plan for
    world_size (with dp left free on an elastic resume), else the recipe's, re-derived on an elastic resume.
    torchft replica groups heal from live peers instead and keep their layout (pipetrain.parallel.replicas.failover)."""
    saved = saved_layout(recipe.run.output_dir, resume) if recipe.parallel.fault_tolerance != "torchft" else None
    if not recipe.parallel.auto:
        return elastic_recipe(recipe, world_size, saved)
    elastic = is_elastic(recipe, saved, world_size)
    recipe = resolve_at_launch(recipe, recipe_path, overrides, world_size, rank, free=("dp",) if elastic else ())
    note = f"elastic resume: {saved.path} was saved on {saved.world_size} rank(s); parallel.auto re-planned " \
           f"for {world_size}" if elastic else None
    return recipe, note


def _with(recipe: Recipe, dp: int | None, microbatches: int) -> Recipe:
    p = recipe.parallel
    # a dp_shard pinned for the old dp is kept only where it still divides the new one (its default follows dp)
    dp_shard = p.dp_shard if p.dp_shard is not None and dp is not None and dp % p.dp_shard == 0 else None
    return dataclasses.replace(recipe, parallel=dataclasses.replace(p, dp=dp, microbatches=microbatches,
                                                                    dp_shard=dp_shard))
