"""The optimizer the trainer drives, and the learning-rate schedule.

build_optimizer returns replicated AdamW (Optimizer, parallel.zero = 0) or ZeRO-sharded AdamW
(pipetrain.parallel.data.zero, parallel.zero = 1 | 2; parallel.data.zero3 for 3); both have the same interface: zero_grad();
backward...; reduce_grads(); clip_grad_norm(max_norm) -> global norm; step(lr); state_items() /
load_state_items(read) for checkpoints (pipetrain.optim.adamw describes the state boxes).
lr_at is the learning-rate schedule (train.lr_schedule, with warmup: pipetrain.lr_schedule).
"""
from __future__ import annotations


import torch
import torch.nn as nn

from pipetrain import lr_schedule
from pipetrain.config import TrainConfig
# build_adamw is re-exported for benchmarks/foundation.py's plain-PyTorch baseline
from pipetrain.optim.adamw import (ReadBox, StateEntry, build_adamw, is_tied, param_boxes,  # noqa: F401
                                   param_groups, set_lr, step_adamw)
from pipetrain.optim.torch_opt import (build_torch_opt, load_torch_opt_state, torch_opt_state_bytes,
                                       torch_opt_state_items)
from pipetrain.parallel.data.grads import (GradNormGroups, clip_grad_norm, global_grad_norm_tensor, step_on_device,
                                           sync_grads, tied_copy_names)
from pipetrain.parallel.replicas.periodic import PeriodicSyncOptimizer
from pipetrain.parallel.replicas.stale import StaleSyncOptimizer
from pipetrain.parallel.replicas.wrapped import ReplicaOptimizer, needs_replica_sync, sync_mode
from pipetrain.parallel.data.zero import ZeroOptimizer
from pipetrain.parallel.data.zero3 import Zero3Optimizer
from pipetrain.parallel.expert.zero import ExpertZero3Optimizer, ExpertZeroOptimizer


class Optimizer:
    """AdamW over this rank's parameters with replicated state (parallel.zero = 0).

    The trainer drives every optimizer the same way, so ZeRO (pipetrain.parallel.data.zero) is a drop-in:
    zero_grad(); backward...; reduce_grads(); clip_grad_norm(max_norm) -> global norm; step(lr).
    """

    def __init__(self, model: nn.Module, dims, cfg: TrainConfig, dp_group="dp"):
        """dp_group: the group gradients are summed over ("dp": dims.dp_group; a relaxed run passes its
        dp_shard group, and a pipetrain.parallel.replicas wrapper reduces across replicas)."""
        self.model, self.dims, self.cfg = model, dims, cfg
        # Under context parallelism each cp rank's gradient covers only its slice of the tokens, so "dp"
        # sums over dp x cp (the loss is already divided by the global target count).
        data_group = dims.dp_group if dims.cp == 1 else dims.dp_cp_group
        self.dp_group = data_group if dp_group == "dp" else dp_group
        self.torch_opt = build_torch_opt(param_groups(model, cfg.weight_decay), cfg)
        self.steps_taken = 0
        # the parameters are fixed once the optimizer holds them: a list, not a walk over every module per step
        self._params = list(model.parameters())
        self._norm_groups = GradNormGroups(model, dims)

    def zero_grad(self) -> None:
        for p in self._params:
            p.grad = None

    def reduce_grads(self) -> None:
        sync_grads(self.model, self.dims, self.dp_group)

    def clip_grad_norm(self, max_norm: float) -> float:
        return clip_grad_norm(self.model, self.dims, max_norm, extra_sq=getattr(self, "extra_grad_sq", 0.0),
                              groups=self._norm_groups)

    @property
    def steps_on_device(self) -> bool:
        """Whether clip_and_step can clip, check and step without reading anything to the host: torch's
        fused AdamW (CUDA) takes the clip as its grad_scale and skips itself on found_inf."""
        return bool(self.torch_opt.defaults.get("fused"))

    def clip_and_step(self, max_norm: float, lr: float, loss_sum: torch.Tensor) -> torch.Tensor:
        """clip_grad_norm + step(lr) with no host read (steps_on_device, grads.step_on_device): weights stay as
        they were when the norm or loss_sum (the step's global loss) is not finite, and the caller, reading
        both afterwards, raises. Returns the norm (0-dim fp32 tensor on the device)."""
        norm = global_grad_norm_tensor(*self._norm_groups.sq_norms(self.dims), self.dims)
        step_on_device([self.torch_opt], lambda: self.step(lr), norm, max_norm, loss_sum)
        return norm

    def step(self, lr: float) -> None:
        set_lr(self.torch_opt, lr)
        step_adamw(self.torch_opt)
        self.steps_taken += 1

    def _entries(self) -> list[StateEntry]:
        return [e for e in param_boxes(self.model) if e[1].requires_grad]

    def state_items(self) -> list[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
        """(name, local tensor, global shape, offsets) of every optimizer tensor this rank owns."""
        skip = tied_copy_names(self.model)
        return torch_opt_state_items(self.torch_opt, [e for e in self._entries() if e[0] not in skip], self.steps_taken)

    def load_state_items(self, read: ReadBox) -> None:
        """Load every moment this rank needs (the tied head copy from its embedding's entries)."""
        self.steps_taken = load_torch_opt_state(self.torch_opt, self._entries(), read, is_tied(self.model))

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank (the AdamW moments; 0 before the first step)."""
        return torch_opt_state_bytes(self.torch_opt)


# parallel.dp_sync (as sync_mode resolves it) -> the wrapper that exchanges across replicas
REPLICA_SYNC = {"bsp": ReplicaOptimizer, "ssp": StaleSyncOptimizer, "dssp": StaleSyncOptimizer,
                "local_sgd": PeriodicSyncOptimizer, "diloco": PeriodicSyncOptimizer}


def build_optimizer(model: nn.Module, dims, cfg: TrainConfig, zero: int = 0, parallel=None, start_step: int = 0):
    """The optimizer for parallel.zero: replicated (0) or ZeRO-sharded across dp_shard (1, 2, 3), train.optimizer
    inside; wrapped in REPLICA_SYNC's wrapper for parallel.dp_sync (pipetrain.parallel.replicas) when the mode is
    relaxed or the replicas must be reduced after the shards (parallel: the recipe's ParallelConfig; None = bsp)."""
    across = parallel is not None and needs_replica_sync(parallel, dims, zero)
    if zero == 0 or dims.zero_shard == 1:
        replica_opt = Optimizer(model, dims, cfg, dp_group=dims.dp_shard_group if across else "dp")
    elif zero == 3:  # under ep: experts shard and gather over expert-dp, the rest over dp
        zero3 = ExpertZero3Optimizer if getattr(dims, "ep", 1) > 1 else Zero3Optimizer
        replica_opt = zero3(model, dims, cfg, reshard_after_forward=parallel is None or parallel.reshard_after_forward)
    elif getattr(dims, "ep", 1) > 1:  # experts shard over expert-dp, the rest over dp
        replica_opt = ExpertZeroOptimizer(model, dims, cfg, stage=zero)
    else:
        replica_opt = ZeroOptimizer(model, dims, cfg, stage=zero)
    if not across:
        return replica_opt
    return REPLICA_SYNC[sync_mode(parallel)](replica_opt, dims, parallel, cfg, start_step)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (1-based): warmup, then train.lr_schedule (lr_schedule.py)."""
    return lr_schedule.lr_at(step, cfg)
