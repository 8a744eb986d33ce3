"""The training loop: per step, forward/backward over microbatches, gradient sync and clipping,
optimizer step, metrics, evaluation and checkpoints.

The loss of a step is the mean cross-entropy per target token over the whole global batch: each
microbatch contributes sum(CE) / (target tokens in the global batch), so summing gradients over
microbatches and dp ranks gives exactly the single-process gradient whatever the layout.
"""
from __future__ import annotations

import math
import os
import time
from typing import Callable, Sequence

import torch
import torch.nn as nn

from pipetrain.checkpoint.save import Item, owned_tensors
from pipetrain.config import Recipe
from pipetrain.data import IGNORE_INDEX, Batch, Loader
from pipetrain.faults import Faults
from pipetrain.metrics import MetricsLogger, peak_memory_bytes
from pipetrain.models import flops_per_token
from pipetrain.models.moe import moe_step_end
from pipetrain.optim.build import lr_at
from pipetrain.parallel.mesh.comm import all_reduce_, max_over_world_async, sum_over_world_
from pipetrain.parallel.tensor.cross_entropy import head_cross_entropy, vocab_parallel_cross_entropy
from pipetrain.parallel.replicas.dbs import DynamicBatch
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.pipeline.executor import Executor, to_device
from pipetrain.parallel.data.grads import clip_coefficient
from pipetrain.parallel.replicas.wrapped import sync_mode
from pipetrain.parallel.pipeline.schedules import Action


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became NaN or inf; raised before the optimizer step touches weights."""


def loss_sum(logits: torch.Tensor, targets: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Sum of per-token cross-entropy over non-ignored targets (0 with a gradient path when none are).
    targets may still be on the CPU: counting them there costs no device synchronisation."""
    count = int((targets != IGNORE_INDEX).sum())
    if count == 0:
        return logits.sum() * 0.0
    targets = to_device(targets, logits.device)
    return vocab_parallel_cross_entropy(logits, targets, IGNORE_INDEX, tp_group) * count


def fused_loss_sum(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, tp_group=None) -> torch.Tensor:
    """loss_sum of head(hidden) with the head fused into the loss (train.fused_loss): the last stage
    returns the final norm's output and the (B, T, V) logits never exist whole."""
    count = int((targets != IGNORE_INDEX).sum())
    if count == 0:
        return (hidden.sum() + head.weight.sum()) * 0.0
    targets = to_device(targets, hidden.device)
    return head_cross_entropy(hidden, head, targets, IGNORE_INDEX, tp_group) * count


class Trainer:
    """Runs a built run (pipetrain.build.build_trainer assembles one); holds its state between steps."""

    def __init__(self, recipe: Recipe, dims: ParallelDims, model: nn.Module, optimizer, loader: Loader,
                 executor: Executor, actions: Sequence[Action], eval_actions: Sequence[Action],
                 logger: MetricsLogger, *, checkpointer=None, start_step: int = 0,
                 peak_tflops: float | None = None, tokenizer=None,
                 dynamic_batch: DynamicBatch | None = None, schedule_for: Callable[[int], list] | None = None,
                 ps=None):
        """model: this rank's (pruned, sharded) module, which executor runs chunk by chunk; actions /
        eval_actions: this rank's schedule for a training step / an evaluation batch; peak_tflops: per
        device, for MFU (None: no MFU); checkpointer None: save nothing. dynamic_batch: the replicas'
        microbatch counts (parallel.dynamic_batch; the loader already serves them); schedule_for(k):
        this rank's training schedule for k microbatches. ps: the parameter-server client
        (pipetrain.parallel.ps.client.PSClient) when parallel.ps_servers > 0."""
        self.recipe, self.dims, self.model, self.optimizer, self.loader = recipe, dims, model, optimizer, loader
        self.executor, self.actions, self.eval_actions = executor, list(actions), list(eval_actions)
        self.logger, self.checkpointer, self.tokenizer = logger, checkpointer, tokenizer
        self.step = start_step
        self.peak = peak_tflops
        self.device = dims.device
        self.tokens_seen = start_step * recipe.train.global_batch * recipe.train.seq_len
        self.flops_per_token = flops_per_token(recipe.model, recipe.train.seq_len)
        self.stop_requested = False  # set by a SIGTERM handler: save and exit cleanly
        self.resumed_from: str | None = None  # the checkpoint this run resumed from (set by build_trainer)
        self.dbs, self.schedule_for = dynamic_batch, schedule_for
        self._schedules = {recipe.parallel.microbatches: self.actions}
        self._slot_seconds = 0.0  # this step's compute per pipeline slot (dynamic batch measurement)
        self._agreements: list = []  # (vector, work) of agreements not yet waited for
        self.ps = ps

    # -- one step ------------------------------------------------------------------------------
    def microbatches(self) -> int:
        """This rank's microbatches this step: parallel.microbatches, or its replica's dynamic count."""
        if self.dbs is None:
            return self.recipe.parallel.microbatches
        return self.dbs.counts[self.dims.dp_replicate_rank]

    def forward_backward(self, batch: Batch, num_targets: int) -> torch.Tensor:
        """Run the step's schedule over every microbatch; return this rank's summed loss (not averaged)."""
        k = self.microbatches()
        if k not in self._schedules:  # schedules are data: one per count, built when first needed
            self._schedules[k] = self.schedule_for(k)
        return self.executor.run(self._schedules[k], batch.split(k), num_targets)

    def _global_loss_sum(self, local_sum: torch.Tensor) -> torch.Tensor:
        """Every rank gets the step's summed loss, on the device (reading it waits for the step's work):
        summed over dp ranks and stages (only the last stage holds a loss); tp ranks hold the same value,
        so only tp rank 0 contributes."""
        if self.dims.world_size > 1:
            local_sum = local_sum.clone()
            if self.dims.tp_rank != 0:
                local_sum.zero_()
            sum_over_world_(local_sum, self.dims.world_size)
        return local_sum

    def _sum_expert_counts(self, table: torch.Tensor) -> torch.Tensor:
        """moe_step_end's reduction: the step's expert counts summed over dp and pp (each pp stage fills
        its own layers' rows) in place; tp ranks saw the same tokens, so the world sum counts them tp times."""
        sum_over_world_(table, self.dims.world_size)
        return table.div_(self.dims.tp)

    def _replica_loss(self, local_sum: torch.Tensor, num_targets: int) -> float:
        """Under a relaxed parallel.dp_sync: this replica's loss (summed over its ranks only, so no
        collective reaches the other replicas), scaled to a mean over its share of the batch."""
        local_sum = local_sum.clone()
        if self.dims.tp_rank != 0:
            local_sum.zero_()
        if self.dims.replica_group is not None:
            all_reduce_(local_sum, self.dims.replica_group)
        return float(local_sum) * self._replica_scale() / num_targets

    def _replica_scale(self) -> float:
        """Global batch / this replica's samples: dp_replicate for an even split."""
        if self.dbs is None:
            return float(self.dims.dp_replicate)
        return self.dbs.total / self.dbs.counts[self.dims.dp_replicate_rank]

    def _faults(self) -> Faults:
        if getattr(self, "_faults_obj", None) is None:
            self._faults_obj = Faults(self.recipe.faults, self.dims.rank)
            self._faults_obj.announce()
        return self._faults_obj

    def drain_replicas(self) -> None:
        """Before a checkpoint: ssp / dssp apply their pending updates; local_sgd / diloco prepare the
        replicas' averages beside each replica's own state, changing nothing (parallel/replicas/).
        A no-op for bsp."""
        drain = getattr(self.optimizer, "drain", None)
        if drain is not None:
            cfg = self.recipe.train
            drain(self.step, lambda k: lr_at(k, cfg), cfg.grad_clip)

    def checkpoint_state(self, trainable_only: bool) -> tuple[int, list[Item], dict]:
        """What this rank saves (pipetrain.checkpoint.save.Saveable), at the step boundary: the parameter
        servers are told to join the save, relaxed replicas are drained first."""
        if self.ps is not None:
            self.ps.announce_save(self.step)
        self.drain_replicas()
        items = owned_tensors(self.model, self.optimizer, self.dims, trainable_only)
        return self.step, items, {"tokens": self.tokens_seen, "data": self.loader.state_dict()}

    def train_step(self) -> dict:
        t0 = time.perf_counter()
        cfg = self.recipe.train
        faults = self._faults()
        faults.maybe_kill(self.step + 1)
        if not self.model.training:  # after an evaluation or a sample: a walk over every module otherwise
            self.model.train()
        self.optimizer.zero_grad()
        set_microbatches = getattr(self.optimizer, "set_microbatches", None)
        if set_microbatches is not None:  # ZeRO's overlapped reduction: backward passes this step (DBS moves it)
            set_microbatches(self.microbatches())
        t_compute = time.perf_counter()  # after zero_grad: under torchft it waits for the step's quorum
        batch, num_targets = self.loader.next()
        if self.ps is not None:  # this step's embedding rows (pipetrain.parallel.ps.client)
            self.ps.begin_step(self.step + 1, batch.inputs)
            if self.ps.early and self.step + 1 < cfg.steps:  # ssp / async: the next rows overlap this step
                self.ps.prefetch(self.step + 2, self.loader.peek_inputs())
        local = self.forward_backward(batch, num_targets)
        # an injected straggler takes f x this step's compute (forward and backward; waits on peers excluded)
        compute_s = time.perf_counter() - t_compute
        slept = faults.straggle(self.step + 1, compute_s)
        if self.dbs is not None:
            self._slot_seconds = (compute_s + slept) / self.dbs.slots(self.microbatches())
            self.optimizer.replica_scale = self._replica_scale()  # local_sgd / diloco: the replica's mean
        self.optimizer.reduce_grads()
        if self.ps is not None:  # the table's rows go to the servers; bsp returns their squared norm
            self.optimizer.extra_grad_sq = self.ps.push(self.step + 1)
        relaxed = getattr(self.optimizer, "sync_step", None)
        loss_sum = None
        if relaxed is not None and sync_mode(self.recipe.parallel) != "bsp":
            loss = self._replica_loss(local, num_targets)
        elif relaxed is not None:
            loss = float(self._global_loss_sum(local)) / num_targets
        else:
            # read after the gradient norm: the host waits for the GPU once before the optimizer step, not
            # twice, and the norm's launches queue behind the backward instead of after a wait
            loss_sum, loss = self._global_loss_sum(local), None
        if hasattr(self.optimizer, "replica_loss"):  # torchft: sync_step sums it over the live replica groups
            self.optimizer.replica_loss = loss

        def check(grad_norm: float) -> None:
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                raise TrainingDiverged(f"loss is {loss} and grad norm {grad_norm} at step {self.step + 1}; "
                                       "weights were not updated and no checkpoint was written; lower train.lr "
                                       "or raise train.warmup_steps, then resume from the last checkpoint")

        extra = {}
        if relaxed is not None:
            check(0.0)
            grad_norm, lr, extra = relaxed(self.step + 1, lambda k: lr_at(k, cfg), cfg.grad_clip, check,
                                           compute_s + slept)
        elif self.ps is None and getattr(self.optimizer, "steps_on_device", False):
            # nothing is read to the host until the whole step is queued: the GPU never waits for the host
            # mid-step. A non-finite loss or norm makes the fused update skip itself; the read raises.
            lr = lr_at(self.step + 1, cfg)
            norm = self.optimizer.clip_and_step(cfg.grad_clip, lr, loss_sum)
            loss, grad_norm = torch.stack([loss_sum.float(), norm]).tolist()
            loss /= num_targets
            check(grad_norm)
        else:
            grad_norm = self.optimizer.clip_grad_norm(cfg.grad_clip)
            loss = float(loss_sum) / num_targets
            check(grad_norm)
            lr = lr_at(self.step + 1, cfg)
            if self.ps is not None:
                self.ps.apply(self.step + 1, clip_coefficient(grad_norm, cfg.grad_clip), lr)
                if not self.ps.early and self.step + 1 < cfg.steps:  # bsp: the next rows arrive while this step ends
                    self.ps.prefetch(self.step + 2, self.loader.peek_inputs())
            self.optimizer.step(lr)
        self.step += 1
        moe = moe_step_end(self.model, self._sum_expert_counts)  # {} for a dense model
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
        if slept:
            record["injected_delay_s"] = slept
        if self.ps is not None:
            record.update(ps_version=self.ps.version, ps_pull_bytes=self.ps.bytes_pulled,
                          ps_push_bytes=self.ps.bytes_pushed)
        record.update(moe)  # aux_loss, expert_load_max / expert_load_mean per layer (models/moe.py)
        record.update(extra)  # relaxed sync: wait_s, replica_bytes, clock_lead / clock_lag, applied
        if self.dbs is not None:  # samples of the global batch each replica took
            record["dbs_shares"] = [k * self.dbs_microbatch * self.dims.dp_shard for k in self.dbs.counts]
        return record

    # -- evaluation ----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean loss per target token over run.eval_batches validation batches, logged; {} (nothing logged)
        when the data holds no validation window (build.py warned)."""
        if self.loader.data.num_val_windows == 0:
            return {}
        self.model.eval()
        total = torch.zeros((), device=self.device)
        count = 0
        for batch in self.loader.val_batches(self.recipe.run.eval_batches):
            if self.ps is not None:
                self.ps.begin_eval(self.step, batch.inputs)
            total += self.executor.run(self.eval_actions, batch.split(self.recipe.parallel.microbatches), 1,
                                       forward_only=True)
            count += int((batch.targets != IGNORE_INDEX).sum())
        if not self.executor.holds_last_stage:  # rank pp-1, or rank 0 for the V schedules
            total.zero_()  # the token count is known everywhere; the loss only on the last stage
            count = 0
        stats = torch.tensor([float(total), float(count)], dtype=torch.float64, device=self.device)
        if self.dims.tp_rank != 0:
            stats.zero_()
        sum_over_world_(stats, self.dims.world_size)
        loss_total, tokens = float(stats[0]), int(stats[1])
        record = {"step": self.step, "eval_loss": loss_total / max(tokens, 1), "eval_tokens": tokens}
        self.logger.log(record)
        return record

    @property
    def dbs_microbatch(self) -> int:
        """Samples in one microbatch (the dynamic batch's unit)."""
        return self.recipe.train.global_batch // self.dims.dp // self.recipe.parallel.microbatches

    def agreement_lag(self) -> int:
        """Steps between starting a step's agreement and acting on it: 0 under bsp; 1 under a relaxed
        dp_sync, so a stop lands at the next step boundary (the mode's own bound, up to sync_every
        steps, could outlast run.stop_timeout_s) while no rank blocks on a step it has just finished."""
        if self.dims.dp_replicate == 1 or sync_mode(self.recipe.parallel) == "bsp":
            return 0
        return 1

    def agree(self, final: bool = False) -> bool:
        """After each step: every rank contributes (stop requested?, its replica's seconds per slot) to a
        max over the world, started now and acted on agreement_lag() steps later, so every rank acts on
        the same step's agreement at the same step. Returns True when every rank is to stop now: SIGTERM
        reaches ranks at different moments, and all must leave the loop after the same step or the next
        collective hangs. A background checkpoint that failed on any rank raises its error on every rank
        at the same step. Under a dynamic batch the agreed times feed the split (DynamicBatch.update).
        final: wait for every agreement still in flight (the loop ends)."""
        save_failed = bool(self.checkpointer is not None and self.checkpointer.failed)
        if self.dims.world_size == 1 and self.dbs is None:
            if save_failed:
                self.checkpointer.wait()  # raises the background save's error
            return self.stop_requested
        width = 2 + (self.dbs.replicas if self.dbs is not None else 0)
        if not final:
            vector = torch.zeros(width, dtype=torch.float64, device=self.device)
            vector[0] = float(self.stop_requested)
            vector[1] = float(save_failed)
            if self.dbs is not None:
                vector[2 + self.dims.dp_replicate_rank] = self._slot_seconds
            self._agreements.append((vector, max_over_world_async(vector, self.dims.world_size)))
        stop = False
        while len(self._agreements) > (0 if final else self.agreement_lag()):
            vector, work = self._agreements.pop(0)
            work.wait()
            values = vector.tolist()
            stop = stop or values[0] > 0
            if values[1] > 0:  # a background checkpoint failed: every rank raises its error at this step
                self.checkpointer.wait()
            if self.dbs is not None:
                self.dbs.observe(values[2:])
                if self.dbs.update():
                    self.loader.use_counts(self.dbs.counts, self.dims.dp_shard, self.dbs_microbatch)
        if stop:
            self.stop_requested = True
        return stop

    # -- the loop ------------------------------------------------------------------------------
    def fit(self) -> list[dict]:
        run, steps = self.recipe.run, self.recipe.train.steps
        every = self.recipe.checkpoint.every
        history = []
        if self.step >= steps:  # --resume into a run that already reached train.steps: nothing trains or is written
            return self._nothing_to_train()
        self.logger.banner(self.recipe, self.dims, self.step)
        try:
            while self.step < steps:
                record = self.train_step()
                if record.get("ft_committed") is False:  # torchft redoes it: the redo is its one line
                    continue
                history.append(record)
                self.logger.log(record)  # every step to metrics.jsonl; the console every run.log_every
                if run.eval_every and self.step % run.eval_every == 0 and self.step < steps:
                    self.evaluate()
                if self.checkpointer and every and self.step % every == 0 and self.step < steps:
                    self.logger.save_checkpoint(self.checkpointer, self)
                if self.agree():
                    self.logger.write(f"stop requested: saving at step {self.step} and exiting")
                    break
            self.agree(final=True)
            if self.checkpointer:
                self.logger.save_checkpoint(self.checkpointer, self)
                self.checkpointer.wait()  # the run ends with its last checkpoint written
            if not self.stop_requested:
                self.evaluate()
            if self.ps is not None:
                self.ps.stop(self.step)
            self.logger.summary()
        finally:
            self.logger.close()
        return history

    def _nothing_to_train(self) -> list[dict]:
        """fit() of a run resumed at or past train.steps: no training, evaluation or metrics line. A checkpoint of
        this run's own folder is left as it is (as a launch without --resume into a finished run, pipetrain.rerun);
        one from another folder is saved into this one, in this run's layout (a conversion). Parameter servers
        are told to stop."""
        own = os.path.join(self.recipe.run.output_dir, "checkpoints")
        source = self.resumed_from
        if self.checkpointer is not None and source is not None and \
                os.path.realpath(os.path.dirname(source)) != os.path.realpath(own):
            self.logger.save_checkpoint(self.checkpointer, self)
            self.checkpointer.wait()
            self.logger.write(f"nothing to train: the checkpoint resumed ({source}) is at step {self.step} of "
                              f"train.steps={self.recipe.train.steps}; saved it in this run's layout")
        elif source is None:  # a fresh run of train.steps=0
            self.logger.write("nothing to train: train.steps=0; set train.steps to the steps to train")
        else:
            self.logger.write(f"nothing to train: the checkpoint resumed is at step {self.step} of train.steps="
                              f"{self.recipe.train.steps}; raise train.steps to continue the run, or set "
                              "run.output_dir for a new one")
        if self.ps is not None:
            self.ps.stop(self.step)
        self.logger.close()
        return []
