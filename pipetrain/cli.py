"""Command line: `train.py --recipe R [--set k=v ...] [--resume auto|DIR] [--eval-only]`.

Assembles one run in the order DESIGN.md gives (recipe -> mesh -> model on meta -> tensor parallel
-> pipeline stage -> materialise -> recompute -> optimizer -> Trainer). Exit codes: 0 success,
2 bad input (one `error: ...` line on stderr, no traceback), 1 any other failure, 130 on Ctrl-C.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pipetrain import checkpoint
from pipetrain.config import ConfigError, Recipe, dump_recipe, load_recipe, validate_layout
from pipetrain.generate import end_of_run_sample


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="train.py", description="Train a GPT-style model with pipetrain.")
    parser.add_argument("--recipe", required=True, help="path to a YAML recipe, e.g. recipes/tiny.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe key, e.g. --set parallel.tp=2 (repeatable)")
    parser.add_argument("--resume", default=None, metavar="auto|DIR",
                        help="continue from the newest checkpoint in run.output_dir (auto) or from DIR")
    parser.add_argument("--eval-only", action="store_true", help="evaluate once, write one eval line, exit")
    return parser.parse_args(argv)


def _init_distributed(world_size: int) -> None:
    if world_size == 1 or dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=timedelta(minutes=int(os.environ.get("PIPETRAIN_TIMEOUT_MIN", 10))))


def layout_problems(recipe: Recipe, world_size: int) -> list[str]:
    problems = validate_layout(recipe, world_size)
    from pipetrain.parallel.pipeline import validate_pipeline
    from pipetrain.parallel.tensor import validate_tensor_parallel
    problems += validate_tensor_parallel(recipe.model, recipe.parallel.tp, recipe.train.seq_len,
                                         recipe.parallel.sequence_parallel)
    problems += validate_pipeline(recipe.model, recipe.parallel)
    return problems


def resolve_init_from(recipe: Recipe) -> Recipe:
    """With model.init_from, the Hugging Face config defines the model (contradicting keys are errors)
    and its directory is the default tokenizer."""
    if not recipe.model.init_from:
        return recipe
    import dataclasses

    from pipetrain.config import validate
    from pipetrain.hf import model_config_from_hf
    if not os.path.isdir(recipe.model.init_from):
        raise ConfigError(f"model.init_from={recipe.model.init_from}: no such directory; point it at a local "
                          "Hugging Face model folder (config.json + model.safetensors)")
    model = model_config_from_hf(recipe.model.init_from, recipe.model)
    data = recipe.data if recipe.data.tokenizer else dataclasses.replace(recipe.data,
                                                                          tokenizer=recipe.model.init_from)
    recipe = dataclasses.replace(recipe, model=model, data=data)
    problems = validate(recipe)
    if problems:
        raise ConfigError("; ".join(problems))
    return recipe


def build_run(recipe: Recipe, resume: str | None):
    """Everything a run needs: (dims, model, chunks, specs, optimizer, loader, tokenizer, checkpointer, start)."""
    from pipetrain.data import Loader, PackedData, load_tokenizer, tokenize_corpus
    from pipetrain.models import build, materialize
    from pipetrain.optim import build_optimizer
    from pipetrain.parallel.dims import ParallelDims
    from pipetrain.parallel.pipeline import build_stage
    from pipetrain.parallel.recompute import apply_recompute

    dims = ParallelDims.init(recipe.parallel)
    if recipe.parallel.zero >= 1 and dims.dp == 1 and dims.rank == 0:
        print(f"warning: parallel.zero={recipe.parallel.zero} has no effect with dp=1 (nothing to shard across); "
              "launch more data-parallel ranks or set parallel.zero=0", file=sys.stderr)
    tokenizer = load_tokenizer(recipe.data.tokenizer)
    if recipe.model.init_from:
        from pipetrain.hf import check_tokenizer_vocab
        check_tokenizer_vocab(tokenizer, recipe.model)
    elif len(tokenizer) > recipe.model.vocab_size:
        raise ConfigError(f"model.vocab_size={recipe.model.vocab_size} is smaller than the tokenizer's "
                          f"{len(tokenizer)} tokens; raise model.vocab_size to at least {len(tokenizer)}")
    # Local rank 0 tokenises (and caches) first so the other ranks on the machine read the cache.
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        tokens, mask = tokenize_corpus(recipe.data, tokenizer)
    if dims.world_size > 1:
        dist.barrier()
    if int(os.environ.get("LOCAL_RANK", 0)) != 0:
        tokens, mask = tokenize_corpus(recipe.data, tokenizer)
    data = PackedData(tokens, mask, recipe.train.seq_len, recipe.data.val_fraction, recipe.data.seed)
    loader = Loader(data, recipe.train.global_batch, dims.dp_rank, dims.dp)

    model = build(recipe.model, device="meta")
    if dims.tp > 1:
        from pipetrain.parallel.tensor import apply_tensor_parallel
        apply_tensor_parallel(model, dims, sequence_parallel=recipe.parallel.sequence_parallel)
    model, chunks, specs = build_stage(model, dims, recipe.parallel, recipe.train.seq_len)
    ckpt_dir = _resume_dir(recipe, dims, resume)
    if recipe.model.init_from and ckpt_dir is None:
        from pipetrain.hf import load_hf_weights
        load_hf_weights(model, recipe.model.init_from, recipe.model, device=dims.device)
    else:  # a resumed run overwrites these weights from the checkpoint
        materialize(model, recipe.model, recipe.train.seed, dims.device)
    apply_recompute(model, recipe.parallel)
    optimizer = build_optimizer(model, dims, recipe.train, recipe.parallel.zero)
    start = 0
    if ckpt_dir is not None:
        manifest = checkpoint.load(ckpt_dir, {"model": model, "optimizer": optimizer, "loader": loader}, recipe, dims)
        start = manifest["step"]
        if dims.rank == 0:
            print(f"resumed from {ckpt_dir} at step {start}", flush=True)
    checkpointer = checkpoint.Checkpointer(recipe.run.output_dir, recipe, dims)
    return dims, model, chunks, specs, optimizer, loader, tokenizer, checkpointer, start


def _resume_dir(recipe: Recipe, dims, resume: str | None) -> str | None:
    """The checkpoint to resume from: None (fresh), the newest intact one (auto), or DIR."""
    if resume is None:
        return None
    if resume != "auto":
        if not os.path.isdir(resume):
            raise ConfigError(f"--resume {resume}: no such checkpoint directory; pass a checkpoints/step-... "
                              "folder or --resume auto")
        return resume
    # rank 0 verifies and chooses, so every rank resumes from the same checkpoint
    choice = [checkpoint.find_resumable(recipe.run.output_dir) if dims.rank == 0 else None]
    if dims.world_size > 1:
        dist.broadcast_object_list(choice, src=0)
    if choice[0] is None and dims.rank == 0:
        print(f"--resume auto: no complete checkpoint in {recipe.run.output_dir}; starting fresh", flush=True)
    return choice[0]


def _prepare_output_dir(recipe: Recipe, rank: int, resume: str | None) -> str:
    out = recipe.run.output_dir
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        if resume is None and os.path.isdir(os.path.join(out, "checkpoints")) and os.listdir(
                os.path.join(out, "checkpoints")):
            raise ConfigError(f"run.output_dir={out} already holds checkpoints; pass --resume auto to continue "
                              "that run or set run.output_dir to a new folder")
        if resume is None and os.path.exists(os.path.join(out, "metrics.jsonl")):
            os.remove(os.path.join(out, "metrics.jsonl"))  # a fresh run starts a fresh metrics file
        dump_recipe(recipe, os.path.join(out, "recipe.yaml"))
    return out


def _truncate_metrics(path: str, step: int) -> None:
    """A resumed run rewrites history after its checkpoint: drop metric lines past that step."""
    if not os.path.exists(path):
        return
    import json
    with open(path) as f:
        keep = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


def run(args: argparse.Namespace) -> int:
    from pipetrain.trainer import Trainer

    recipe = resolve_init_from(load_recipe(args.recipe, args.set))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    problems = layout_problems(recipe, world_size)
    if problems:
        raise ConfigError("; ".join(problems))
    _init_distributed(world_size)
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(recipe.train.seed)
    out = _prepare_output_dir(recipe, rank, args.resume)
    dims, model, chunks, specs, optimizer, loader, tokenizer, checkpointer, start = build_run(recipe, args.resume)
    if rank == 0 and args.resume is not None:
        _truncate_metrics(os.path.join(out, "metrics.jsonl"), start)
    trainer = Trainer(recipe, dims, model, optimizer, loader, out, chunks=chunks, specs=specs,
                      checkpointer=None if args.eval_only else checkpointer, start_step=start)
    if args.eval_only:
        trainer.evaluate()
        trainer.logger.close()
        return 0
    signal.signal(signal.SIGTERM, lambda *_: setattr(trainer, "stop_requested", True))
    trainer.fit()
    if dims.world_size > 1:
        dist.barrier()  # every rank has finished its collectives before any tears its groups down
    if rank == 0 and recipe.run.sample_tokens:
        print(end_of_run_sample(model, tokenizer, recipe, dims, trainer.step), flush=True)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    try:
        return run(args)
    except ConfigError as exc:
        # Every rank usually raises the same error; rank-specific ones carry "[rank N | ...]".
        if rank == 0 or "[rank" in str(exc):
            print(f"error: {exc}", file=sys.stderr)
        else:  # let rank 0 print first: torchrun stops every worker as soon as one exits non-zero
            time.sleep(5)
        return 2
    except KeyboardInterrupt:
        if rank == 0:
            print("interrupted: stopped before finishing (no partial checkpoint was written)", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 -- report, then exit 1 as DESIGN.md specifies
        from pipetrain.trainer import TrainingDiverged
        if isinstance(exc, TrainingDiverged):
            print(f"error: {exc}", file=sys.stderr)
            return 1
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
