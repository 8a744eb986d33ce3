"""Command line: `train.py --recipe R [--set k=v ...] [--resume auto|DIR] [--eval-only] [--dry-run [--nproc N]]`.

Parses the arguments, checks the recipe's layout for the world size, starts the process group,
prepares the output directory, calls pipetrain.build.build_trainer and runs it. Exit codes:
0 success (also after SIGTERM: saved at the next step boundary), 2 bad input (one `error: ...` line
on stderr, no traceback), 1 any other failure (TrainingDiverged prints one line), 130 on Ctrl-C, 143
when SIGTERM found no step boundary within run.stop_timeout_s or a second SIGTERM came
(pipetrain.stopping).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pipetrain.build import build_server, build_trainer, resolve_init_from
from pipetrain.checkpoint.writer import CheckpointSaveError, restore_set_aside
from pipetrain.config import ArgumentParser, ConfigError, Recipe, dump_recipe, load_recipe
from pipetrain.dry_run import dry_run
from pipetrain.elastic import launch_layout
from pipetrain.faults import restart_count
from pipetrain.generate import end_of_run_sample
from pipetrain.parallel.mesh.comm import barrier
from pipetrain.parallel.mesh.dims import ParallelDims, local_cuda_index
from pipetrain.parallel.replicas.failover import Replica, replica_from_env
from pipetrain.parallel.mesh.rules import layout_problems, parallel_problems
from pipetrain.preflight import preflight
from pipetrain.rerun import finished_report, rerun_of
from pipetrain.run_lock import RunLock
from pipetrain.stopping import INTERRUPT_EXIT, StopGuard
from pipetrain.trainer import TrainingDiverged

MAX_TIMEOUT_MIN = 10 ** 6  # about two years; 1e20 minutes overflowed timedelta (a traceback)


def parse_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(prog="train.py", description="Train a GPT-style model with pipetrain.")
    parser.add_argument("--recipe", required=True,
                        help="path to a YAML recipe, or a shipped recipe's name (tiny, gpt-1b, ...)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe key, e.g. --set parallel.tp=2 (repeatable)")
    parser.add_argument("--resume", default=None, metavar="auto|DIR",
                        help="continue from the newest checkpoint in run.output_dir (auto) or from DIR")
    parser.add_argument("--eval-only", action="store_true", help="evaluate once, write one eval line, exit")
    parser.add_argument("--dry-run", action="store_true", help="validate, print stages, schedule and memory, exit")
    parser.add_argument("--nproc", type=int, default=None, help="--dry-run: world size (default WORLD_SIZE or 1)")
    return parser.parse_args(argv)


def whole_number(text: str) -> bool:
    """Digits 0-9 only (around spaces): str.isdigit() also takes a superscript such as "\u00b2", which int() refuses."""
    return text.strip().isascii() and text.strip().isdigit()


def launcher_int(name: str, default: int, minimum: int = 0) -> int:
    """A whole number the launcher (torchrun) sets in the environment (WORLD_SIZE, RANK), or default when it is
    unset; ConfigError (one line) for anything else."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    if not whole_number(raw) or int(raw) < minimum:
        raise ConfigError(f"{name}={raw!r}: must be a whole number >= {minimum}; launch with torchrun, which sets "
                          "it, or unset it")
    return int(raw)


def _init_distributed(world_size: int) -> None:
    if world_size == 1 or dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(local_cuda_index())
        backend = "nccl"
    else:
        backend = "gloo"
    minutes = os.environ.get("PIPETRAIN_TIMEOUT_MIN", "10")
    if not whole_number(minutes) or not 1 <= int(minutes) <= MAX_TIMEOUT_MIN:
        raise ConfigError(f"PIPETRAIN_TIMEOUT_MIN={minutes!r}: must be a whole number of minutes in [1, "
                          f"{MAX_TIMEOUT_MIN}] (the collectives' timeout); unset it for the default 10")
    timeout = timedelta(minutes=int(minutes))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent hosts one store for every attempt and env:// does not prefix its keys, so after
        # a restart a rank can read the previous attempt's gloo/NCCL addresses and fail to connect; the
        # keys of each attempt get their own prefix here.
        store = dist.PrefixStore(f"pipetrain/attempt-{restart_count()}/",
                                 dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                               is_master=False, timeout=timeout))
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), world_size=world_size,
                                timeout=timeout)
        return
    dist.init_process_group(backend, timeout=timeout)


def _checkpoint_around(folder: str) -> str | None:
    """The pipetrain checkpoint (a step-* folder holding manifest.json) that folder is, or sits in; None if none.
    A run written into a checkpoint made it unreadable, and re-saving that step later deleted the run."""
    path = os.path.realpath(folder)
    while True:
        if os.path.basename(path).startswith("step-") and os.path.isfile(os.path.join(path, "manifest.json")):
            return path
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


def _prepare_output_dir(recipe: Recipe, rank: int, resume: str | None, eval_only: bool = False) -> RunLock | None:
    """Rank 0 creates run.output_dir, locks it for this run (one run per output directory) and refuses to
    overwrite another run's checkpoints or to save where a stray file sits. Returns the lock (None on other
    ranks). The resolved recipe is saved there once the run is built (_train): a launch refused after this
    point leaves the recipe.yaml of the run that owns the folder as it was."""
    out = recipe.run.output_dir
    if rank != 0:
        return None
    checkpoint = _checkpoint_around(out)
    if checkpoint:
        raise ConfigError(f"run.output_dir={out} is inside the checkpoint {checkpoint} (a step folder "
                          "holding manifest.json), which a run never writes into; choose a folder outside it")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"run.output_dir={out}: cannot be created ({exc.strerror or exc}: {exc.filename or out}); "
                          "choose a writable folder") from None
    lock = RunLock(out).acquire()
    try:
        ckpts = os.path.join(out, "checkpoints")
        if os.path.lexists(ckpts) and not os.path.isdir(ckpts):
            raise ConfigError(f"run.output_dir={out}: {ckpts} is a file, not a folder; move it away")
        restore_set_aside(ckpts)  # a re-save killed between its renames
        stray = sorted(n for n in (os.listdir(ckpts) if os.path.isdir(ckpts) else [])
                       if n.startswith(("step-", ".tmp-step-")) and not os.path.isdir(os.path.join(ckpts, n)))
        if stray:
            raise ConfigError(f"run.output_dir={out}: {os.path.join(ckpts, stray[0])} is a file where a checkpoint "
                              "folder would go; move it away")
        if resume is None and os.path.isdir(ckpts) and os.listdir(ckpts):
            raise ConfigError(f"run.output_dir={out} already holds checkpoints; pass --resume auto to continue "
                              "that run or set run.output_dir to a new folder")
        metrics = os.path.join(out, "metrics.jsonl")
        if os.path.isdir(metrics):
            raise ConfigError(f"run.output_dir={out}: {metrics} is a folder where the metrics file goes; move it away")
        if resume is None and not eval_only and os.path.lexists(metrics):
            os.remove(metrics)  # a fresh run starts a fresh metrics file
        elif os.path.islink(metrics) or (os.path.lexists(metrics) and not os.path.isfile(metrics)):
            # kept, read and appended to: a pipe blocked a resume forever, --eval-only appended through a link
            kind = "a link" if os.path.islink(metrics) else "not a regular file (a pipe, a socket or a device)"
            raise ConfigError(f"run.output_dir={out}: {metrics} is {kind} where the metrics file goes; move it away")
    except BaseException:
        lock.release()
        raise
    return lock


def run(args: argparse.Namespace) -> int:
    recipe = resolve_init_from(load_recipe(args.recipe, args.set, rules=parallel_problems))
    if args.nproc is not None and (not args.dry_run or args.nproc < 1):
        raise ConfigError(f"--nproc={args.nproc}: it sets the world size of --dry-run and must be >= 1; "
                          "pass --dry-run --nproc N with N >= 1 (torchrun sets the world size of a real run)")
    world_size = args.nproc if args.dry_run and args.nproc else launcher_int("WORLD_SIZE", 1, minimum=1)
    launcher_int("RANK", 0)  # read as int below
    servers = recipe.parallel.ps_servers  # the world's last ranks serve the embedding (pipetrain.parallel.ps.server)
    if servers and servers >= world_size:
        raise ConfigError(f"parallel.ps_servers={servers} leaves no worker in a world of {world_size} processes; "
                          f"launch dp*tp*pp + {servers} processes (torchrun --nproc-per-node)")
    if servers and args.eval_only:
        raise ConfigError("--eval-only with parallel.ps_servers: evaluate without servers (the checkpoint "
                          "loads into any layout); drop parallel.ps_servers and launch dp*tp*pp processes")
    workers = world_size - servers
    restarted = restart_count() > 0 and args.resume is None
    if restarted:  # torchrun --max-restarts: a restarted attempt continues from the newest intact checkpoint
        args.resume = "auto"
    if args.resume is None and not args.dry_run and _continue_saved_run(args, recipe):
        return 0
    if recipe.parallel.auto and not args.dry_run:
        _init_distributed(world_size)  # parallel.auto's ranks agree on one device profile (plan.auto)
    recipe, elastic_note = launch_layout(recipe, args.recipe, args.set, workers, int(os.environ.get("RANK", 0)),
                                         args.resume)
    if args.dry_run:
        if elastic_note and int(os.environ.get("RANK", 0)) == 0:
            print(elastic_note, flush=True)
        return dry_run(recipe, workers, int(os.environ.get("RANK", 0)))
    recipe, replica, problems = _replica_layout(recipe, workers)
    if problems:
        raise ConfigError("; ".join(problems))
    _init_distributed(world_size)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and restarted:
        print(f"torchrun restart {restart_count()}: resuming from the newest intact checkpoint "
              f"(as --resume auto)", flush=True)
    if rank == 0 and elastic_note:
        print(elastic_note, flush=True)
    lock = _prepare_output_dir(recipe, rank, args.resume, args.eval_only)
    try:
        preflight(recipe, workers)  # before any allocation: sizes that cannot fit, batches the data cannot supply
        if rank >= workers:
            return _serve(args, recipe)
        return _train(args, recipe, rank, workers, replica)
    finally:
        if lock is not None:
            lock.release()


def _continue_saved_run(args: argparse.Namespace, recipe: Recipe) -> bool:
    """A launch without --resume into an output directory that holds checkpoints of the same recipe resumes
    them (sets args.resume to auto); another recipe's raise ConfigError (pipetrain.rerun). True when that run
    already reached train.steps: its final metrics are printed and nothing is trained (--eval-only evaluates)."""
    rank = int(os.environ.get("RANK", 0))
    saved = rerun_of(recipe)
    if saved is None:
        return False
    if saved.step >= recipe.train.steps and not args.eval_only:
        if rank == 0:
            print(finished_report(saved, recipe), flush=True)
        return True
    args.resume = "auto"
    if rank == 0:
        print(f"run.output_dir={recipe.run.output_dir} holds checkpoints of this recipe: resuming from the newest "
              "intact one (as --resume auto)", flush=True)
    return False


def _serve(args: argparse.Namespace, recipe: Recipe) -> int:
    """A parameter-server rank: hold and update the embedding rows until rank 0 says stop."""
    build_server(recipe, ParallelDims.init(recipe.parallel), resume=args.resume).serve()
    return 0


def _replica_layout(recipe: Recipe, world_size: int) -> tuple[Recipe, Replica | None, list[str]]:
    """The layout problems; under parallel.fault_tolerance=torchft this torchrun is one replica group
    (pipetrain.parallel.replicas.failover): its layout is checked as a standalone run of the group and it writes into
    run.output_dir/replica-<REPLICA_GROUP_ID>."""
    if recipe.parallel.fault_tolerance != "torchft":
        return recipe, None, layout_problems(recipe, world_size)
    replica, problems = replica_from_env(recipe, world_size)
    if replica is None:
        return recipe, None, problems
    run = dataclasses.replace(recipe.run, output_dir=replica.output_dir(recipe.run.output_dir))
    return dataclasses.replace(recipe, run=run), replica, layout_problems(replica.local_recipe(recipe), world_size)


def _train(args: argparse.Namespace, recipe: Recipe, rank: int, world_size: int, replica: Replica | None) -> int:
    trainer = build_trainer(recipe, resume=args.resume, eval_only=args.eval_only, replica=replica)
    saved = os.path.join(recipe.run.output_dir, "recipe.yaml")
    if rank == 0 and not (args.eval_only and os.path.exists(saved)):  # an evaluation leaves the run's recipe
        dump_recipe(recipe, saved)  # built: the checkpoint, the data and the layout were accepted
    if args.eval_only:
        trainer.evaluate()
        trainer.logger.close()
        return 0
    guard = StopGuard(trainer, recipe.run.stop_timeout_s, os.path.join(recipe.run.output_dir, "checkpoints"),
                      rank).install()
    finished = trainer.step >= recipe.train.steps  # resumed at the end: fit() trains and writes nothing
    try:
        trainer.fit()
        barrier(world_size)  # every rank has finished its collectives before any tears its groups down
    finally:
        guard.uninstall()
        if replica is not None:
            trainer.optimizer.shutdown()  # torchft's manager server and checkpoint transport
    if finished:
        return 0
    if rank == 0 and recipe.run.sample_tokens and not trainer.stop_requested and trainer.ps is not None:
        print("run.sample_tokens: no sample under parallel.ps_servers (the table lives on the servers); "
              "generate from the checkpoint: python -m pipetrain.generate", flush=True)
    elif rank == 0 and recipe.run.sample_tokens and not trainer.stop_requested:
        print(end_of_run_sample(trainer.model, trainer.tokenizer, recipe, trainer.dims, trainer.step), flush=True)
    return 0


def record_error(line: str) -> None:
    """Leave line where torch.distributed.elastic looks for a worker's error (TORCHELASTIC_ERROR_FILE, set by
    torchrun), so torchrun's failure summary names it as the root cause instead of "To enable traceback
    see ...". A plain string message is a form its reader takes as is."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)


def main(argv=None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    try:
        return run(args)
    except ConfigError as exc:
        record_error(f"error: {exc}")
        # Every rank usually raises the same error; rank-specific ones carry "[rank N | ...]".
        if rank == 0 or "[rank" in str(exc):
            print(f"error: {exc}", file=sys.stderr)
        else:  # let rank 0 print first: torchrun stops every worker as soon as one exits non-zero
            time.sleep(5)
        return 2
    except KeyboardInterrupt:
        if rank == 0:
            print("interrupted: stopped before finishing (no partial checkpoint was written)", file=sys.stderr)
        return INTERRUPT_EXIT
    except TrainingDiverged as exc:  # exit 1 as DESIGN.md specifies, with one line instead of a traceback
        record_error(f"error: {exc}")
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except CheckpointSaveError as exc:  # the file system failed, not the input: exit 1, one line (every rank agrees)
        record_error(f"error: {exc}")
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            # Work handles still referenced (reference cycles in the trainer) must go while the interpreter is
            # alive: destroyed during its finalization, gloo's aborts the process (SIGABRT)
            gc.collect()
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
