"""ZeRO 1/2/3 under expert parallelism: two ZeroOptimizers (Zero3Optimizers) over one model, one per group.

Non-expert parameters shard (and reduce) over dp as without ep. Expert weights are already split over the
ep group, and ranks holding the same experts form the expert-dp group (dp / ep ranks): their gradients
reduce and their rows shard over it; with expert-dp of one rank they stay unsharded (each ep rank the only
holder of its experts). Under context parallelism both groups take cp in (dims.zero_shard, and
dims.expert_zero_shard: expert-dp x cp), as each cp rank's gradient of its own tokens sums over cp too.
Checkpoint boxes follow: an expert shard's box is its ep slice of the global (E, ...) tensor narrowed to its
expert-dp (x cp) rows, so the state reshards to any ep.

HSDP (parallel.dp_shard < dp): both parts shard inside one replica, the dense rows over dp_shard and the expert
rows over the replica's holders of the same experts (dims.expert_zero_shard: dp_shard / ep ranks); the replica
wrapper (parallel/replicas/wrapped.py) then sums each rank's rows of both parts over dp_replicate, whose ranks
hold the same rows.

Clipping: each rank's squares of its rows, over both optimizers, summed over all of dp (x cp) give the
global norm: the non-expert rows are split over dp (x cp), the expert rows over ep (which experts) x
expert-dp (x cp) (which rows) = dp (x cp); under HSDP the same over one replica's dp_shard (its replicas hold
the same rows). The AdamW step count is written once, by the non-expert optimizer. With fused AdamWs (CUDA) the clip, the check and both updates stay on the device (clip_and_step,
as ZeroOptimizer's).

ZeRO 3 (ExpertZero3Optimizer, torchtitan's FSDP of the experts over expert-dp): the parameters themselves are
those rows. Each part's UnitGatherer (pipetrain.parallel.data.units) hooks the same blocks: before a block runs,
the non-expert part all-gathers its dense weights over dp and the expert part its E/ep local experts over
expert-dp (x cp), each frees them after, and each reduce-scatters its gradients over its own group; under HSDP
over dp_shard and the replica's dp_shard / ep holders of its experts. A checkpoint's weights are both parts' row
boxes (param_items), as its moments are.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from pipetrain.config import TrainConfig
from pipetrain.optim.adamw import ReadBox
from pipetrain.parallel.data.grads import clip_coefficient, expert_param_ids, global_grad_norm_tensor, step_on_device
from pipetrain.parallel.data.zero import ZeroOptimizer
from pipetrain.parallel.data.zero3 import Zero3Optimizer


class ExpertZeroOptimizer:
    """ZeRO stage 1 or 2 with expert weights sharded over expert-dp; the ZeroOptimizer interface."""

    def __init__(self, model: nn.Module, dims, cfg: TrainConfig, stage: int):
        experts = expert_param_ids(model)
        self.model, self.dims, self.stage = model, dims, stage
        self.dense = self._part(model, dims, cfg, owns=lambda p: id(p) not in experts)
        self.experts = self._part(model, dims, cfg, owns=lambda p: id(p) in experts,
                                  shard_over=dims.expert_zero_shard, sync_model_parallel=False)
        self.parts = (self.dense, self.experts)

    def _part(self, model: nn.Module, dims, cfg: TrainConfig, **keys) -> ZeroOptimizer:
        return ZeroOptimizer(model, dims, cfg, self.stage, **keys)

    @property
    def steps_taken(self) -> int:
        return self.dense.steps_taken

    def set_microbatches(self, num_microbatches: int) -> None:
        for part in self.parts:
            part.set_microbatches(num_microbatches)

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()

    def reduce_grads(self) -> None:
        for part in self.parts:  # the dense part first: it syncs tp-partial and tied gradients
            part.reduce_grads()

    def _norm(self) -> torch.Tensor:
        """The global gradient norm from both parts' rows, on the device."""
        sums = [part.grad_sq_sums() for part in self.parts]
        sharded, replicated = sums[0][0] + sums[1][0], sums[0][1] + sums[1][1]
        return global_grad_norm_tensor(sharded, replicated, self.dims, dp_sharded=True,
                                       shard_group=self.dims.zero_shard_group)

    def clip_grad_norm(self, max_norm: float) -> float:
        norm = float(self._norm())
        coef = clip_coefficient(norm, max_norm)
        if coef is not None:
            for part in self.parts:
                part.scale_grads(coef)
        return norm

    @property
    def steps_on_device(self) -> bool:
        return all(part.steps_on_device for part in self.parts)

    def clip_and_step(self, max_norm: float, lr: float, loss_sum: torch.Tensor) -> torch.Tensor:
        """As ZeroOptimizer's, over both parts (grads.step_on_device); returns the norm on the device."""
        norm = self._norm()
        step_on_device([part.torch_opt for part in self.parts], lambda: self.step(lr), norm, max_norm, loss_sum)
        return norm

    def step(self, lr: float) -> None:
        for part in self.parts:
            part.step(lr)

    def state_items(self) -> list:
        """Both parts' row shards of the moments; the scalar "step" once."""
        return self.dense.state_items() + [item for item in self.experts.state_items() if item[0] != "step"]

    def load_state_items(self, read: ReadBox) -> None:
        for part in self.parts:
            part.load_state_items(read)

    def state_bytes(self) -> int:
        return sum(part.state_bytes() for part in self.parts)

    def grad_bytes(self) -> int:
        return sum(part.grad_bytes() for part in self.parts)


class ExpertZero3Optimizer(ExpertZeroOptimizer):
    """ZeRO stage 3 with expert weights sharded, gathered and reduce-scattered over expert-dp (module docstring);
    the Zero3Optimizer interface."""

    def __init__(self, model: nn.Module, dims, cfg: TrainConfig, reshard_after_forward: bool = True, **keys):
        self.reshard_after_forward, self.keys = reshard_after_forward, keys  # keys: Zero3Optimizer's bucket_bytes
        super().__init__(model, dims, cfg, stage=3)

    def _part(self, model: nn.Module, dims, cfg: TrainConfig, **keys) -> Zero3Optimizer:
        return Zero3Optimizer(model, dims, cfg, self.reshard_after_forward, **self.keys, **keys)

    def param_items(self, trainable_only: bool = False) -> list:
        return [item for part in self.parts for item in part.param_items(trainable_only)]

    def load_param_items(self, read: ReadBox, trainable_only: bool = False) -> None:
        for part in self.parts:
            part.load_param_items(read, trainable_only)

    def param_bytes(self) -> int:
        return sum(part.param_bytes() for part in self.parts)

    def full_params(self) -> dict[str, torch.Tensor]:
        """Both parts' UnitGatherer.full_params: every local parameter whole (the experts: this ep rank's)."""
        return {name: t for part in self.parts for name, t in part.gatherer.full_params().items()}
