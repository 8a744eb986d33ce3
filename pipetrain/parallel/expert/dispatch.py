"""Expert-parallel dispatch: each ep rank holds E/ep experts; a MoE layer sends every (token, expert) pair
to the rank owning the expert, computes there, and sends the outputs back.

The MoE layer (pipetrain.models.moe) stays blind to this: apply_expert_parallel replaces its
dispatch_compute_combine step from outside (the router, the aux loss and the counts run unchanged on
this rank's tokens). One forward on ep rank r, owning experts [r*E_l, (r+1)*E_l):

    sort the N*k (token, expert) rows by expert        rows for rank j are then contiguous
    all-to-all of the per-expert counts                 (ep, E_l): rows of each local expert from each rank
    all-to-all of the rows (uneven splits)              (M, D), grouped by source rank, then expert
    regroup by local expert, grouped SwiGLU, ungroup    the same expert math as one process
    reverse all-to-all, weight, sum per token           (N, D)

Dropless as one process: every row is computed by its expert, whatever the skew (a rank's batch is as
large as the routing makes it). Gradients flow back through the autograd-aware all-to-all (its backward is
the reverse all-to-all), so an expert's weight gradient on its rank sums the rows of every ep rank's
tokens; the expert-dp reduction (pipetrain.parallel.data.grads) adds the other ep groups'. Under tp the
experts are also F-sharded; tp rank t exchanges only with the ranks of its own ep group (same tp
coordinate), each computing its F slice, and the MoE's tp region sums them afterwards.

Shapes: N tokens of this rank, k experts per token, D model, E experts, E_l = E/ep local experts,
M rows received, F expert ffn (F/tp under tp).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from pipetrain.models.moe import Experts, MoE, grouped_swiglu, moe_layers
from pipetrain.parallel.mesh.comm import all_to_all_single, all_to_all_tokens, group_device
from pipetrain.parallel.mesh.dims import ParallelDims


class ExpertParallelDispatch:
    """MoE.dispatch_compute_combine over the ep group: (B, T, D) -> (B, T, D), sum_k w_k * expert_{idx_k}(x)."""

    def __init__(self, moe: MoE, dims: ParallelDims):
        self.moe, self.ep_group, self.ep = moe, dims.ep_group, dims.ep
        self.local = moe.num_experts // dims.ep  # E_l

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        shape, k, E_l = x.shape, self.moe.top_k, self.local
        x = x.reshape(-1, shape[-1])  # (N, D)
        flat = topk_idx.reshape(-1)  # (N*k,)
        order = torch.argsort(flat, stable=True)  # rows grouped by expert, so by owning rank too
        token = order // k
        counts = torch.bincount(flat, minlength=self.moe.num_experts)  # (E,)
        # (ep, E_l): received[j, e] = rows rank j sends for this rank's local expert e
        received = all_to_all_single(counts.to(group_device(self.ep_group)), [E_l] * self.ep, [E_l] * self.ep,
                                     self.ep_group).view(self.ep, E_l).to(counts.device)
        in_splits = counts.view(self.ep, E_l).sum(1).tolist()
        out_splits = received.sum(1).tolist()
        rows = all_to_all_tokens(x[token], out_splits, in_splits, self.ep_group)  # (M, D) by source, expert
        # regroup by local expert (stable: source rank order, then the sender's token order, inside one)
        expert_of_row = torch.repeat_interleave(torch.arange(E_l, device=rows.device).repeat(self.ep),
                                                received.reshape(-1).to(rows.device))
        by_expert = torch.argsort(expert_of_row, stable=True)
        y = self._compute(rows[by_expert], received.sum(0))  # (M, D) in local expert order
        y = y[torch.argsort(by_expert)]  # back to arrival order
        y = all_to_all_tokens(y, in_splits, out_splits, self.ep_group)  # (N*k, D) in `order`
        y = y * topk_w.reshape(-1)[order].unsqueeze(-1)
        out = x.new_zeros(x.shape, dtype=y.dtype)  # y * w: fp32 under autocast (MoE.route)
        return out.index_add_(0, token, y).view(shape)

    def _compute(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        e = self.moe.experts
        if rows.shape[0] == 0:
            # no row reached this rank: the expert weights still get a (zero) gradient, so the expert-dp
            # reduction and ZeRO's bucket counts see the same gradients on every rank
            return rows + 0.0 * (e.gate.sum() + e.up.sum() + e.down.sum())
        return grouped_swiglu(rows, counts, e.gate, e.up, e.down, e.fp8_grouped)


def _local_experts(module: Experts, dims: ParallelDims) -> Experts:
    """This ep rank's E/ep experts (dim 0), keeping tp's F shards; param_shards lists both dims."""
    E, F, D = module.gate.shape
    E_l = E // dims.ep
    with torch.device(module.gate.device):
        new = Experts(E_l, D, F).to(module.gate.dtype)
    tp_shards = getattr(module, "param_shards", {})
    new.param_shards = {name: ((0, dims.ep_rank, dims.ep),) + ((tp_shards[name],) if name in tp_shards else ())
                        for name in ("gate", "up", "down")}
    lo = dims.ep_rank * E_l
    with torch.no_grad():
        for name, p in new.named_parameters():
            full = getattr(module, name)
            if not full.is_meta:
                p.copy_(full[lo:lo + E_l])
    return new


def apply_expert_parallel(model: nn.Module, dims: ParallelDims) -> None:
    """Keep this ep rank's experts in every MoE layer and dispatch its tokens over dims.ep_group, in place.
    A no-op when dims.ep == 1. After apply_tensor_parallel (it keeps tp's F shards)."""
    if dims.ep == 1:
        return
    cfg = model.cfg
    assert cfg.num_experts % dims.ep == 0, \
        f"{dims.coords} apply_expert_parallel: ep={dims.ep} does not divide num_experts={cfg.num_experts}"
    if dims.ep_group is None:
        raise ValueError(f"{dims.coords} apply_expert_parallel: ep={dims.ep} but dims has no ep_group; build dims "
                         "with ParallelDims.init / from_degrees after init_process_group")
    for moe in moe_layers(model).values():
        moe.experts = _local_experts(moe.experts, dims)
        # an instance attribute shadows the method: the layer's forward calls this step instead
        moe.dispatch_compute_combine = ExpertParallelDispatch(moe, dims)
