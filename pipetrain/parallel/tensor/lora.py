"""LoRA under tensor parallelism: where each adapter's rows live and how its partial sums are reduced.

The adapter math (shapes, initialisation, the forward y = base(x) + (alpha / r) B A x, merging) is
layout-free and lives in pipetrain/models/lora.py; apply_lora gives it this rank's layout of each
projection. No communication is added beyond the base projection's own:
- column-parallel base (wq, wk, wv, gate, up: output rows split): B is split by output rows like the
  base weight, A is replicated. The input x is already inside the tp region (the attn / mlp pre-hook's
  copy_to_tp, or the sequence gather), whose backward all-reduces dx, so the adapter's contribution to
  dx (partial on each rank: only its rows of B) is summed there for free. A's own gradient is partial
  in the same way; it is listed in `tp_partial_grads`, so sync_tp_partial_grads sums it once per
  optimizer step (r x D_in numbers) instead of adding a per-microbatch all-reduce of the (B, T, r)
  adapter activation, which would be the alternative (copy_to_tp on A x).
- row-parallel base (wo, down: input columns split): A is split by input columns like the base weight,
  B is replicated. Each rank's (alpha/r) B A_local x_local is a partial sum, added to the base's
  partial product BEFORE its all-reduce (or reduce-scatter under sequence parallelism), so one
  reduction sums both. B's gradient (dy^T times this rank's partial A x) is tp-partial: listed too.
- replicated kv heads (n_kv_heads < tp): A and B are replicated like wk / wv and each rank uses B's
  rows of its kv head; both gradients are tp-partial.
Shards are declared in `param_shards`, so checkpoints, the gradient norm and ZeRO see the adapters as
ordinary sharded or replicated parameters. Pipeline and data parallelism need nothing: the adapters
are parameters of the layers they sit in.
"""
from __future__ import annotations

import torch.nn as nn

from pipetrain.config import ModelConfig
from pipetrain.models.lora import AdapterLayout, LoRAAdapted, add_adapters
from pipetrain.parallel.mesh.comm import reduce_from_tp, reduce_scatter_sequence
from pipetrain.parallel.tensor.layers import ColumnParallelLinear, ReplicatedKVLinear, RowParallelLinear
from pipetrain.parallel.pipeline.weight_grads import linear


class LoRARowAdapted(LoRAAdapted):
    """RowParallelLinear's forward with the adapter's partial sum added before the tp reduction."""

    def forward(self, x):  # x (B, T, D_in/tp); y: this rank's partial sum, the base fp8 under train.precision=fp8
        y = linear(x, self.weight, None, self.fuse, self.deferred, self.fp8, self.work_key) + self.lora_delta(x)
        if self.sequence_parallel:
            y = reduce_scatter_sequence(y, self.tp_group)  # (B, T/tp, D_out)
        else:
            y = reduce_from_tp(y, self.tp_group)  # (B, T, D_out)
        return y if self.bias is None else y + self.bias


def tp_layout(tp: int, tp_rank: int):
    """The per-projection layout callback of this tp rank (module docstring)."""
    def layout(module: nn.Module) -> AdapterLayout:
        if isinstance(module, RowParallelLinear):
            return AdapterLayout(shards={"lora_A": (1, tp_rank, tp)}, partial=("lora_B",), mixin=LoRARowAdapted)
        if isinstance(module, ColumnParallelLinear):
            return AdapterLayout(shards={"lora_B": (0, tp_rank, tp)}, partial=("lora_A",))
        if isinstance(module, ReplicatedKVLinear):
            return AdapterLayout(partial=("lora_A", "lora_B"), rows=module.rows)
        return AdapterLayout()
    return layout


def apply_lora(model: nn.Module, cfg: ModelConfig, dims, seed: int) -> list[str]:
    """Add LoRA adapters to model's targeted projections in this rank's tp layout (see
    pipetrain.models.lora.add_adapters). A no-op when cfg.lora_rank is None."""
    tp, tp_rank = getattr(dims, "tp", 1), getattr(dims, "tp_rank", 0)
    return add_adapters(model, cfg, seed, partial_grads=tp > 1, layout=tp_layout(tp, tp_rank))
