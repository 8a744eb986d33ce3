"""One function builds a run: build_trainer(recipe) -> Trainer. The CLI, the tests and the benchmarks call it.

The order is DESIGN.md's run path:

    recipe -> mesh (ParallelDims)            parallel/mesh/dims.py
           -> tokenizer, data, loader        data/
           -> model on meta                  models/
           -> tensor parallel                parallel/tensor/layers.py
           -> expert parallel                parallel/expert/dispatch.py
           -> pipeline stage                 parallel/pipeline/stage.py
           -> weights: seed | Hugging Face | checkpoint   models/init.py, hf/, checkpoint/
           -> recompute                      parallel/pipeline/recompute.py
           -> compile each block (train.compile)  models/compile.py
           -> optimizer (ZeRO over dp)       optim/build.py, parallel/data/zero.py
           -> executor and schedule          parallel/pipeline/executor.py, parallel/pipeline/schedules/
           -> metrics logger, checkpointer   metrics.py, checkpoint/
           -> Trainer                        trainer.py

The recipe's layout must have passed pipetrain.parallel.mesh.rules.layout_problems (the CLI checks it
before starting processes); the layers below only assert it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from typing import Callable

import torch
import torch.nn as nn

from pipetrain.checkpoint.load import check_compatible, check_resume_dir, find_resumable, load as load_checkpoint
from pipetrain.checkpoint.read import TensorReader, checkpoint_dirs, read_manifest
from pipetrain.checkpoint.resume import load_agreed
from pipetrain.checkpoint.save import Checkpointer
from pipetrain.checkpoint.writer import set_aside_later
from pipetrain.config import ConfigError, Recipe, fp8_weights_once_a_run, fused_loss_on, validate
from pipetrain.data import Loader, build_loader, load_tokenizer
from pipetrain.hf.config import model_config_from_hf
from pipetrain.hf.tokenizer import check_tokenizer_vocab
from pipetrain.hf.weights import load_hf_weights
from pipetrain.metrics import MetricsLogger, peak_tflops
from pipetrain.models import build, materialize
from pipetrain.models.moe import set_aux_sequences
from pipetrain.models.compile import apply_compile, check_compile, compile_backend
from pipetrain.optim.build import build_optimizer, lr_at
from pipetrain.parallel.data.zero3 import unit_gatherer
from pipetrain.parallel.mesh.comm import broadcast_object_from_rank0
from pipetrain.parallel.replicas.dbs import DynamicBatch
from pipetrain.parallel.context.attention import apply_context_parallel
from pipetrain.parallel.context.slicing import SequenceSlicer
from pipetrain.parallel.expert.dispatch import apply_expert_parallel
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.mesh.rules import count_rules, parallel_problems
from pipetrain.parallel.pipeline.executor import Executor
from pipetrain.parallel.replicas.failover import FaultTolerantOptimizer, Replica
from pipetrain.parallel.tensor.lora import apply_lora
from pipetrain.parallel.pipeline.stage import build_stage, stage_costs, without_head
from pipetrain.parallel.ps.client import PSClient, PSEmbedding
from pipetrain.parallel.ps.server import Server
from pipetrain.parallel.ps.state import server_log
from pipetrain.parallel.pipeline.recompute import apply_recompute
from pipetrain.parallel.pipeline.schedules import build_schedule, gpipe
from pipetrain.parallel.tensor.fp8 import Fp8WeightCache, apply_fp8, eager_fp8_warning
from pipetrain.parallel.tensor.layers import apply_tensor_parallel
from pipetrain.parallel.pipeline.weight_grads import apply_grad_accumulation_fusion
from pipetrain.trainer import Trainer, fused_loss_sum, loss_sum

OptimizerFactory = Callable[[nn.Module, ParallelDims, Recipe], object]


def precision_problem(device: torch.device, precision: str) -> str | None:
    """Why train.precision cannot run on device (None: it can). bf16, and fp8 (whose other ops run in bf16),
    need compute capability 8.0: before Ampere, ptxas refuses bfloat16 in the Triton kernels
    ("Feature '.bf16' requires .target sm_80 or higher") and cuBLAS has no bfloat16 tensor cores."""
    if device.type != "cuda" or precision == "fp32":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= (8, 0):
        return None
    return (f"train.precision={precision}: needs an NVIDIA GPU of compute capability >= 8.0 (A100, L4, H100 or "
            f"newer) for bfloat16, got {torch.cuda.get_device_name(device)} (sm_{major}{minor}); use "
            "train.precision=fp32")


def resolve_init_from(recipe: Recipe) -> Recipe:
    """With model.init_from, the Hugging Face config defines the model (contradicting keys are errors)
    and its directory is the default tokenizer."""
    if not recipe.model.init_from:
        return recipe
    if not os.path.isdir(recipe.model.init_from):
        raise ConfigError(f"model.init_from={recipe.model.init_from}: no such directory; point it at a local "
                          "Hugging Face model folder (config.json + model.safetensors)")
    model = model_config_from_hf(recipe.model.init_from, recipe.model)
    data = recipe.data if recipe.data.tokenizer else dataclasses.replace(recipe.data,
                                                                          tokenizer=recipe.model.init_from)
    recipe = dataclasses.replace(recipe, model=model, data=data)
    problems = validate(recipe, parallel_problems)
    if problems:
        raise ConfigError("; ".join(problems))
    return recipe


def build_trainer(recipe: Recipe, dims: ParallelDims | None = None, *, resume: str | None = None,
                  eval_only: bool = False, loader: Loader | None = None,
                  optimizer_factory: OptimizerFactory | None = None, replica: Replica | None = None) -> Trainer:
    """Everything a run needs, assembled in DESIGN.md's order, as a Trainer ready to fit() or evaluate().

    dims: the mesh (None: ParallelDims.init(recipe.parallel), creating the process groups).
    resume: None (fresh), "auto" (the newest intact checkpoint in run.output_dir, else fresh) or a
    checkpoint directory. eval_only: no checkpointer. loader: serve these batches instead of
    recipe.data's (no tokenizer is loaded then). optimizer_factory(model, dims, recipe): instead of
    optim.build_optimizer. Metrics go to run.output_dir, which must exist on global rank 0.
    replica: this torchrun is one torchft replica group (parallel.fault_tolerance=torchft,
    pipetrain.parallel.replicas.failover):
    the mesh is the group's own, the loader reads the group's slice of the global batch and the optimizer
    exchanges gradients with the other groups through torchft.
    """
    torch.manual_seed(recipe.train.seed)
    dims = dims or ParallelDims.init(replica.local_parallel(recipe.parallel) if replica else recipe.parallel)
    if recipe.parallel.zero >= 1 and dims.dp == 1 and dims.cp == 1 and dims.rank == 0:  # cp: ZeRO shards over dp x cp
        print(f"warning: parallel.zero={recipe.parallel.zero} has no effect with dp=1 (nothing to shard across); "
              "launch more data-parallel ranks or set parallel.zero=0", file=sys.stderr)
    tokenizer = None
    if loader is None:
        tokenizer = _build_tokenizer(recipe)
        loader = _build_loader(recipe, dims, tokenizer)
    _check_validation(recipe, loader, dims, eval_only)
    if replica is not None:  # the group's dp ranks read its dp_replicate coordinate's slice of the global batch
        loader.dp_rank = replica.replica_id * dims.dp + dims.dp_rank
        loader.dp_size = replica.num_replicas * dims.dp

    if recipe.train.compile:  # before any weight is built: no C++ compiler is a one-line error
        check_compile(dims.device, compile_backend())
    problem = precision_problem(dims.device, recipe.train.precision)
    if problem:
        raise ConfigError(problem)
    if dims.cp > 1:  # every cp rank reads its head and tail chunk of each sequence (parallel/context/)
        loader.sequence_slice = SequenceSlicer(dims.cp, dims.cp_rank)

    model = build(recipe.model, device="meta")
    if dims.tp > 1:
        apply_tensor_parallel(model, dims, sequence_parallel=recipe.parallel.sequence_parallel)
    assert dims.ep == recipe.parallel.ep, f"{dims.coords} dims.ep={dims.ep} but parallel.ep={recipe.parallel.ep}"
    apply_expert_parallel(model, dims)  # after tp: it keeps tp's F shards of its experts
    apply_context_parallel(model, dims, recipe.train.seq_len, recipe.data.document_mask)
    # After tensor parallelism (which would replace the swapped modules); with fusion off it still
    # swaps in the modules whose weight gradients the split backward defers.
    t = recipe.train
    apply_grad_accumulation_fusion(model, t.grad_accumulation_fusion_min_numel if t.grad_accumulation_fusion else None)
    if t.precision == "fp8":  # after both: it sets the fp8 of the modules they made
        apply_fp8(model, dims, recipe.model, t.fp8_emulate, t.fp8_recipe)
        slow = eager_fp8_warning(dims.device, t.fp8_emulate, t.compile)
        if slow and dims.rank == 0:
            print(slow, file=sys.stderr)
    model, chunks, specs = build_stage(model, dims, recipe.parallel, recipe.train.seq_len)
    ps_embed = _use_ps_embedding(model, chunks, recipe, dims)  # parallel.ps_servers: the table lives on servers
    ckpt_dir = _resume_dir(recipe, dims, resume)
    lora = recipe.model.lora_rank is not None
    if recipe.model.init_from and (ckpt_dir is None or lora):  # a LoRA checkpoint holds only the adapters
        load_hf_weights(model, recipe.model.init_from, recipe.model, device=dims.device)
    else:  # a resumed run overwrites these weights from the checkpoint
        materialize(model, recipe.model, recipe.train.seed, dims.device)
    apply_lora(model, recipe.model, dims, recipe.train.seed)  # freezes the base; a no-op without lora_rank
    set_aux_sequences(model, recipe.train.global_batch)  # MoE aux gradient per global-batch sequence
    apply_recompute(model, recipe.parallel, [spec.layers for spec in specs])
    if recipe.train.compile:  # last: it traces what tp, fusion, LoRA and recompute made of each block
        # ZeRO-3 hooks its gathers on blocks; expert parallelism compiles a MoE block's pieces around its dispatch
        apply_compile(model, hooks_outside=recipe.parallel.zero == 3, pieces=recipe.parallel.ep > 1)
    act_dtype = next(model.parameters()).dtype  # the activations' (fp32 masters); ZeRO-3 may make weights bf16
    if optimizer_factory is None:
        optimizer = build_optimizer(model, dims, recipe.train, recipe.parallel.zero, recipe.parallel)
    else:
        optimizer = optimizer_factory(model, dims, recipe)
    if replica is not None:
        optimizer = FaultTolerantOptimizer(optimizer, dims, recipe, replica)
    start = 0
    if ckpt_dir is not None:  # every rank hashes the files it reads; a damaged one moves all ranks together
        parts = {"model": model, "optimizer": optimizer, "loader": loader}
        ckpt_dir, manifest = load_agreed(ckpt_dir, lambda path: load_checkpoint(path, parts, recipe, dims), dims,
                                         auto=resume == "auto", output_dir=recipe.run.output_dir)
        start = manifest["step"]
        if resume != "auto" and not eval_only and dims.rank == 0:  # a rollback to an earlier step of this run
            moved = set_aside_later(os.path.join(recipe.run.output_dir, "checkpoints"), start)
            if moved:
                print(f"resumed from {ckpt_dir}, an earlier step of this run: its {moved[1]} later checkpoint(s) "
                      f"moved to {moved[0]} (kept; out of rotation and --resume auto)", flush=True)
    metrics_path = os.path.join(recipe.run.output_dir, "metrics.jsonl")
    if resume is not None and dims.rank == 0 and not eval_only:  # an evaluation rewrites no training history
        logged = _truncate_metrics(metrics_path, start)  # before the logger opens the file for appending
        if ckpt_dir is not None:
            print(f"resumed from {ckpt_dir} at step {start}; {max(0, logged - start)} logged step(s) after it are "
                  "lost and will be redone", flush=True)

    executor = _build_executor(recipe, dims, chunks, specs, act_dtype=act_dtype, gatherer=unit_gatherer(optimizer),
                               replicas=replica.num_replicas if replica else 1)
    if fp8_weights_once_a_run(recipe):  # after the load and ZeRO: the holders read the weights as they are
        executor.around_run = Fp8WeightCache(model, compile_backend() if t.compile else None).run
    actions, eval_actions = _build_schedules(recipe, dims)
    dynamic = _build_dynamic_batch(recipe, dims, loader)
    logger = MetricsLogger.from_recipe(recipe, recipe.run.output_dir, enabled=dims.rank == 0, start_step=start)
    checkpointer = None if eval_only else Checkpointer(recipe.run.output_dir, recipe, dims)
    ps = PSClient(recipe, dims, ps_embed) if dims.ps_servers else None
    trainer = Trainer(recipe, dims, model, optimizer, loader, executor, actions, eval_actions, logger,
                      checkpointer=checkpointer, start_step=start,
                      peak_tflops=peak_tflops(dims.device, recipe.run.peak_tflops), tokenizer=tokenizer,
                      dynamic_batch=dynamic, schedule_for=lambda k: _training_schedule(recipe, dims, k), ps=ps)
    trainer.resumed_from = ckpt_dir  # agreed by every rank (load_agreed)
    if replica is not None:
        optimizer.attach(trainer)  # healing restores the trainer's step and loader with the weights
    return trainer


def _use_ps_embedding(model: nn.Module, chunks: list, recipe: Recipe, dims: ParallelDims) -> PSEmbedding | None:
    """With parameter servers the first stage's embedding becomes a PSEmbedding (no weight: each
    step's rows are pulled), in the stage module and in the chunk that runs it. Returns it (None on
    other stages or without servers)."""
    if not dims.ps_servers or getattr(model, "embed", None) is None:
        return None
    m = recipe.model
    embed = PSEmbedding(m.vocab_size, m.d_model, dims.tp_group, dims.tp_rank, recipe.parallel.sequence_parallel)
    for module in [model, *chunks]:
        if getattr(module, "embed", None) is not None:
            module.embed = embed
    return embed


def build_server(recipe: Recipe, dims: ParallelDims, resume: str | None = None) -> Server:
    """A parameter-server rank (dims.is_server): its rows of the table, from the seed or the checkpoint
    the workers resume from, and a checkpointer that joins their saves. serve() runs it."""
    ckpt_dir = _resume_dir(recipe, dims, resume)  # the same collective as the workers' in build_trainer
    log = server_log(recipe.run.output_dir, dims.rank - dims.world_size)
    if resume is None and os.path.exists(log):
        os.remove(log)  # a fresh run starts a fresh log, as metrics.jsonl
    elif resume is not None and ckpt_dir is None:
        _truncate_metrics(log, 0)  # --resume auto found nothing: the run starts over
    server = Server(recipe, dims, lambda k: lr_at(k, recipe.train))
    if ckpt_dir is not None:  # the workers' agreement in build_trainer, from the server's side
        load_agreed(ckpt_dir, lambda path: _load_server(server, path, recipe, log), dims, auto=resume == "auto",
                    output_dir=recipe.run.output_dir)
    server.checkpointer = Checkpointer(recipe.run.output_dir, recipe, dims)
    return server


def _load_server(server: Server, ckpt_dir: str, recipe: Recipe, log: str) -> None:
    manifest = read_manifest(ckpt_dir)
    check_compatible(manifest, recipe, ckpt_dir)
    reader = TensorReader(ckpt_dir, manifest, device="cpu", verify=recipe.checkpoint.verify)
    server.load(reader.read, manifest)
    # a resumed run redoes the steps after its checkpoint: cut them out, as metrics.jsonl (a fallback to an
    # older checkpoint cuts further); the cut rewrites the file, so the server reopens it
    _truncate_metrics(log, manifest["step"])
    server.open_log()


def _build_tokenizer(recipe: Recipe):
    tokenizer = load_tokenizer(recipe.data.tokenizer)
    if recipe.model.init_from:
        check_tokenizer_vocab(tokenizer, recipe.model)
    elif len(tokenizer) > recipe.model.vocab_size:
        raise ConfigError(f"model.vocab_size={recipe.model.vocab_size} is smaller than the tokenizer's "
                          f"{len(tokenizer)} tokens; raise model.vocab_size to at least {len(tokenizer)}")
    return tokenizer


def _build_loader(recipe: Recipe, dims: ParallelDims, tokenizer) -> Loader:
    """This dp rank's loader over recipe.data (prepared first when it is raw text; pipetrain.data)."""
    return build_loader(recipe, dims, tokenizer)


def _build_executor(recipe: Recipe, dims: ParallelDims, chunks, specs, act_dtype: torch.dtype,
                    replicas: int = 1, gatherer=None) -> Executor:
    """The executor of this rank's chunks: boundary activations (B/dp/microbatches, T or T/tp, D); replicas:
    torchft replica groups, each with its own dims (dp over all of them is replicas x dims.dp); gatherer:
    ZeRO-3's UnitGatherer, which gathers the head around a fused loss (the head's forward does not run)."""
    p, t = recipe.parallel, recipe.train
    tp_group = dims.tp_group if dims.tp > 1 else None
    micro = t.global_batch // (replicas * dims.dp) // p.microbatches
    seq = t.seq_len // dims.cp // (dims.tp if p.sequence_parallel and dims.tp > 1 else 1)  # this rank's tokens
    if t.precision in ("bf16", "fp8"):  # fp8 linears cast their own operands; the rest runs in bf16
        def autocast():
            return torch.autocast(dims.device.type, dtype=torch.bfloat16)
    else:
        autocast = contextlib.nullcontext
    if fused_loss_on(recipe, dims.device.type) and any(spec.is_last for spec in specs):
        head = next(c.head for c, spec in zip(chunks, specs) if spec.is_last)
        chunks = [without_head(c) if spec.is_last else c for c, spec in zip(chunks, specs)]

        def loss_fn(hidden, targets):
            # under the chunks' autocast: the head's GEMMs run in bf16, as the unfused head's F.linear does
            # (outside it they ran in fp32: on an H100 the fused run had 0.88x the unfused one's tokens/s)
            with autocast():
                if gatherer is not None:
                    return gatherer.call_outside(head, fused_loss_sum, hidden, head, targets, tp_group)
                return fused_loss_sum(hidden, head, targets, tp_group)
    else:
        def loss_fn(logits, targets):
            return loss_sum(logits, targets, tp_group)
    return Executor(chunks, specs, dims, (micro, seq, recipe.model.d_model), act_dtype, loss_fn=loss_fn,
                    autocast=autocast)


def _training_schedule(recipe: Recipe, dims: ParallelDims, microbatches: int) -> list:
    """This rank's actions for a training step of `microbatches` microbatches."""
    p = recipe.parallel
    # Schedules are pure data (validated by the schedules tests); full recompute makes B ~3x F.
    backward_cost = 3.0 if p.recompute == "full" else 2.0
    costs = stage_costs(recipe.model, p, recipe.train.seq_len) if p.schedule == "zbv" else None
    return build_schedule(p.schedule, dims.pp_rank, dims.pp, microbatches, p.virtual_stages,
                          backward_cost=backward_cost, split_backward=p.split_backward and dims.pp > 1,
                          stage_costs=costs)


def _build_dynamic_batch(recipe: Recipe, dims: ParallelDims, loader: Loader) -> DynamicBatch | None:
    """parallel.dynamic_batch: the replicas' microbatch counts, continued from a checkpoint of the same
    layout (an even split otherwise), installed in the loader."""
    p = recipe.parallel
    if not p.dynamic_batch:
        return None
    granule, minimum = count_rules(p.schedule, dims.pp, p.virtual_stages)
    micro = recipe.train.global_batch // dims.dp // p.microbatches
    dbs = DynamicBatch(dims.dp_replicate, p.microbatches, p.dynamic_batch_every, dims.pp, granule, minimum)
    saved = getattr(loader, "saved_split", None)
    if saved is not None:
        same = (saved.get("dp_replicate"), saved.get("dp_shard"), saved.get("microbatch")) == \
            (dims.dp_replicate, dims.dp_shard, micro)
        if same and dbs.valid(saved.get("counts")):
            dbs.counts = list(saved["counts"])
        elif dims.rank == 0:
            print(f"dynamic batch: the checkpoint's split {saved.get('counts')} was for another layout; "
                  "starting from an even split", flush=True)
    loader.use_counts(dbs.counts, dims.dp_shard, micro)
    return dbs


def _build_schedules(recipe: Recipe, dims: ParallelDims) -> tuple[list, list]:
    """This rank's actions for a training step and for an evaluation batch (forward only)."""
    p = recipe.parallel
    actions = _training_schedule(recipe, dims, p.microbatches)
    if p.virtual_stages == 1:
        eval_actions = gpipe(dims.pp_rank, dims.pp, p.microbatches)
    else:
        eval_actions = [a for a in actions if a.kind in ("F", "SEND_ACT", "RECV_ACT")]
    return actions, eval_actions


def _check_validation(recipe: Recipe, loader: Loader, dims: ParallelDims, eval_only: bool) -> None:
    """Without validation windows an evaluation would log a loss of 0 over 0 tokens: --eval-only is refused,
    periodic evaluation skipped with one warning (Trainer.evaluate). A corpus that is one document (a single
    text file) holds out the end of its tokens: only data.val_fraction=0, or a held-out share shorter than one
    window, gives none."""
    if loader.data.num_val_windows > 0 or not (eval_only or recipe.run.eval_every):
        return
    why = (f"data holds no validation window (data.val_fraction={recipe.data.val_fraction} holds out fewer than "
           f"train.seq_len+1={recipe.train.seq_len + 1} tokens of this corpus)")
    if eval_only:
        raise ConfigError(f"--eval-only: the {why}; raise data.val_fraction or use more data")
    if dims.rank == 0:
        print(f"warning: the {why}; evaluation is skipped (run.eval_every={recipe.run.eval_every})", file=sys.stderr)


def _resume_dir(recipe: Recipe, dims: ParallelDims, resume: str | None) -> str | None:
    """The checkpoint to resume from: None (fresh), the newest intact one (auto), or DIR."""
    if resume is None:
        return None
    root = os.path.join(recipe.run.output_dir, "checkpoints")
    if resume != "auto":
        check_resume_dir(resume)
        _refuse_resume_over_other_checkpoints(resume, root)
        return resume
    # rank 0 checks the manifests, headers and sizes (no hashing) and chooses, so every rank starts from the
    # same checkpoint; the hashing happens per rank in load_agreed
    choice, damaged = broadcast_object_from_rank0(  # servers (parallel.ps_servers) take part: they resume too
        (find_resumable(recipe.run.output_dir), checkpoint_dirs(root)) if dims.rank == 0 else None,
        dims.full_world_size)
    if choice is None and damaged:  # a fresh run would overwrite their metrics and rotate them away
        raise ConfigError(f"--resume auto: no intact checkpoint is left in {root} ({len(damaged)} failed "
                          "verification, see the warnings); restore a good copy, or move the checkpoints away to "
                          "start fresh")
    if choice is None and dims.rank == 0:
        print(f"--resume auto: no complete checkpoint in {recipe.run.output_dir}; starting fresh", flush=True)
    return choice


def _refuse_resume_over_other_checkpoints(resume: str, root: str) -> None:
    """--resume DIR of another run into a run.output_dir that holds checkpoints of its own at or past DIR's step:
    training on would overwrite them (the same step's save, then the later ones) and cut its metrics back to
    DIR's step. (Past the folder's newest, as a round trip through another layout does, nothing is lost.)"""
    own = checkpoint_dirs(root)
    if not own or os.path.realpath(os.path.dirname(os.path.normpath(resume))) == os.path.realpath(root):
        return
    try:
        step, newest = read_manifest(resume)["step"], read_manifest(own[-1])["step"]
    except (ConfigError, KeyError, TypeError):  # a damaged manifest: the load that follows says so
        return
    if newest >= step:
        raise ConfigError(f"--resume {resume}: run.output_dir {os.path.dirname(root)} already holds checkpoints of "
                          f"its own up to step {newest}, at or past this checkpoint's step {step}, which resuming "
                          "another run there would overwrite; set run.output_dir to a new folder, or resume its "
                          "own (--resume auto)")


def _truncate_metrics(path: str, step: int) -> int:
    """A resumed run rewrites history after its checkpoint: drop metric lines (and parameter servers' log
    lines) past that step. A line that is not complete JSON (a kill during a metrics write leaves a torn
    last line) ends the file there, with a warning. Returns the newest step the file had logged (0 without a file)."""
    if not os.path.exists(path):
        return 0
    keep, newest = [], 0
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
            if not isinstance(record, dict) or not isinstance(record.get("step", 0), (int, float)):
                raise ValueError("not a JSON object with a numeric step")
        except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            print(f"warning: {path} line {number} is not a complete JSON record (a torn write?); "
                  f"cutting the file back to the {len(keep)} complete line(s) before it", file=sys.stderr)
            break
        if isinstance(record.get("step"), int):
            newest = max(newest, record["step"])
        if record.get("step", 0) <= step:
            keep.append(raw + b"\n")
    if os.path.lexists(path + ".tmp"):  # a link of that name was written through, then became metrics.jsonl
        os.remove(path + ".tmp")
    with open(path + ".tmp", "xb") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)
    return newest
