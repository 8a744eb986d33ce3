"""The training loop: per step, forward/backward over microbatches, gradient sync and clipping,
optimizer step, metrics, evaluation and checkpoints.

The loss of a step is the mean cross-entropy per target token over the whole global batch: each
microbatch contributes sum(CE) / (target tokens in the global batch), so summing gradients over
microbatches and dp ranks gives exactly the single-process gradient whatever the layout.
"""
from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from pipetrain.config import Recipe
from pipetrain.data import IGNORE_INDEX, Batch, Loader
from pipetrain.kernels import cross_entropy
from pipetrain.metrics import MetricsLogger, peak_memory_bytes, peak_tflops
from pipetrain.models import flops_per_token
from pipetrain.optim import lr_at
from pipetrain.parallel.executor import Executor
from pipetrain.parallel.schedules import build_schedule, gpipe


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became NaN or inf; raised before the optimizer step touches weights."""


def loss_sum(logits: torch.Tensor, targets: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Sum of per-token cross-entropy over non-ignored targets (0 with a gradient path when none are).
    targets may still be on the CPU: counting them there costs no device synchronisation."""
    count = int((targets != IGNORE_INDEX).sum())
    if count == 0:
        return logits.sum() * 0.0
    targets = targets.to(logits.device, non_blocking=True)
    return cross_entropy(logits, targets, IGNORE_INDEX, tp_group) * count


class Trainer:
    def __init__(self, recipe: Recipe, dims, model: nn.Module, optimizer, loader: Loader, output_dir: str,
                 chunks=None, specs=None, checkpointer=None, start_step: int = 0):
        """model: this rank's (pruned, sharded) module; chunks/specs: its pipeline chunks (build_stage)."""
        self.recipe, self.dims, self.model, self.optimizer = recipe, dims, model, optimizer
        self.loader, self.output_dir, self.checkpointer = loader, output_dir, checkpointer
        self.step = start_step
        self.tokens_seen = start_step * recipe.train.global_batch * recipe.train.seq_len
        self.device = dims.device
        self.stop_requested = False  # set by a SIGTERM handler: save and exit cleanly
        self.logger = MetricsLogger.from_recipe(recipe, output_dir, enabled=dims.rank == 0, start_step=start_step)
        self.peak = peak_tflops(self.device, recipe.run.peak_tflops)
        self.flops_per_token = flops_per_token(recipe.model, recipe.train.seq_len)
        if chunks is None:
            from pipetrain.parallel.pipeline import ChunkSpec
            chunks, specs = [model], [ChunkSpec(0, tuple(range(recipe.model.n_layers)), True, True)]
        p = recipe.parallel
        tp_group = dims.tp_group if dims.tp > 1 else None
        micro = recipe.train.global_batch // dims.dp // p.microbatches
        seq = recipe.train.seq_len // (dims.tp if p.sequence_parallel and dims.tp > 1 else 1)
        act_dtype = next(model.parameters()).dtype
        self.executor = Executor(chunks, specs, dims, (micro, seq, recipe.model.d_model), act_dtype,
                                 loss_fn=lambda logits, targets: loss_sum(logits, targets, tp_group),
                                 autocast=self._autocast,
                                 fuse_grad_accumulation=recipe.train.grad_accumulation_fusion,
                                 fuse_min_numel=recipe.train.grad_accumulation_fusion_min_numel)
        # Built once: schedules are pure data (validated by the schedules tests); full recompute makes B ~3x F.
        backward_cost = 3.0 if p.recompute == "full" else 2.0
        self.actions = build_schedule(p.schedule, dims.pp_rank, dims.pp, p.microbatches, p.virtual_stages,
                                      backward_cost=backward_cost, split_backward=p.split_backward and dims.pp > 1)
        self.eval_actions = gpipe(dims.pp_rank, dims.pp, p.microbatches) if p.virtual_stages == 1 else \
            [a for a in self.actions if a.kind in ("F", "SEND_ACT", "RECV_ACT")]

    # -- one step ------------------------------------------------------------------------------
    def _autocast(self):
        if self.recipe.train.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward_backward(self, batch: Batch, num_targets: int) -> torch.Tensor:
        """Run the step's schedule over every microbatch; return this rank's summed loss (not averaged)."""
        return self.executor.run(self.actions, batch.split(self.recipe.parallel.microbatches), num_targets)

    def _global_loss(self, local_sum: torch.Tensor, num_targets: int) -> float:
        """Every rank gets the step's loss: summed over dp ranks and stages (only the last stage holds
        a loss); tp ranks hold the same value, so only tp rank 0 contributes."""
        if self.dims.world_size > 1:
            local_sum = local_sum.clone()
            if self.dims.tp_rank != 0:
                local_sum.zero_()
            dist.all_reduce(local_sum)
        return float(local_sum) / num_targets

    def train_step(self) -> dict:
        t0 = time.perf_counter()
        cfg = self.recipe.train
        self.model.train()
        self.optimizer.zero_grad()
        batch, num_targets = self.loader.next()
        local = self.forward_backward(batch, num_targets)
        self.optimizer.reduce_grads()
        loss = self._global_loss(local, num_targets)
        grad_norm = self.optimizer.clip_grad_norm(cfg.grad_clip)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise TrainingDiverged(f"loss is {loss} and grad norm {grad_norm} at step {self.step + 1}; "
                                   "weights were not updated and no checkpoint was written; lower train.lr "
                                   "or raise train.warmup_steps, then resume from the last checkpoint")
        lr = lr_at(self.step + 1, cfg)
        self.optimizer.step(lr)
        self.step += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        step_tokens = cfg.global_batch * cfg.seq_len
        self.tokens_seen += step_tokens
        record = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": self.tokens_seen,
                  "tokens_per_sec": step_tokens / dt, "step_time_s": dt,
                  "peak_mem_bytes": peak_memory_bytes(self.device)}
        if self.peak:
            record["mfu"] = self.flops_per_token * step_tokens / dt / (self.peak * 1e12 * self.dims.world_size)
        return record

    # -- evaluation ----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        self.model.eval()
        total = torch.zeros((), device=self.device)
        count = 0
        for batch in self.loader.val_batches(self.recipe.run.eval_batches):
            total += self.executor.run(self.eval_actions, batch.split(self.recipe.parallel.microbatches), 1,
                                       forward_only=True)
            count += int((batch.targets != IGNORE_INDEX).sum())
        if not self.dims.is_last_stage:
            total.zero_()  # the token count is known everywhere; the loss only on the last stage
            count = 0
        stats = torch.tensor([float(total), float(count)], dtype=torch.float64, device=self.device)
        if self.dims.world_size > 1:
            if self.dims.tp_rank != 0:
                stats.zero_()
            dist.all_reduce(stats)
        loss_total, tokens = float(stats[0]), int(stats[1])
        record = {"step": self.step, "eval_loss": loss_total / max(tokens, 1), "eval_tokens": tokens}
        self.logger.log(record)
        return record

    def _stop_agreed(self) -> bool:
        """True when any rank was asked to stop: SIGTERM reaches ranks at different moments, and
        every rank must leave the loop after the same step or the next collective hangs."""
        if self.dims.world_size == 1:
            return self.stop_requested
        flag = torch.tensor([1.0 if self.stop_requested else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.stop_requested = bool(flag.item())
        return self.stop_requested

    # -- the loop ------------------------------------------------------------------------------
    def fit(self) -> list[dict]:
        run, steps = self.recipe.run, self.recipe.train.steps
        every = self.recipe.checkpoint.every
        history = []
        self.logger.banner(self.recipe, self.dims, self.step)
        try:
            while self.step < steps:
                record = self.train_step()
                history.append(record)
                self.logger.log(record)  # every step to metrics.jsonl; the console every run.log_every
                if run.eval_every and self.step % run.eval_every == 0 and self.step < steps:
                    self.evaluate()
                if self.checkpointer and every and self.step % every == 0 and self.step < steps:
                    self.logger.save_checkpoint(self.checkpointer, self)
                if self._stop_agreed():
                    self.logger.write(f"stop requested: saving at step {self.step} and exiting")
                    break
            if self.checkpointer:
                self.logger.save_checkpoint(self.checkpointer, self)
            if not self.stop_requested:
                self.evaluate()
            self.logger.summary()
        finally:
            self.logger.close()
        return history
