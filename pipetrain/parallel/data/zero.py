"""ZeRO stages 1 and 2: AdamW whose state (stage 1) and gradients (stage 2) are sharded across dp.

Sharding. Every parameter of this (tp, pp) rank is split along its local dim 0 into dp row ranges (under
context parallelism dp x cp ranges over dims.zero_shard_group: "dp" below means that shard group)
with torch.tensor_split semantics (dp_row_ranges: the first rows % dp ranks get one row more, a
parameter with fewer rows than dp leaves some ranks empty). A rank's shard is therefore a box of the
global tensor: the tp slice from param_layout, narrowed on dim 0. Checkpoints read and write these
boxes (state_items / load_state_items), so a state saved at one dp x tp x pp loads into another.

Master weights. Parameters are fp32 (train.precision=bf16 autocasts compute only), so they are the
master weights: each rank updates its rows of them in place and the rows are all-gathered after the
step. Only the AdamW moments are sharded state.

Buckets. Gradients are flattened into buckets of about bucket_bytes. A bucket is laid out rank-major,
(dp, P): part r holds rank r's rows of every parameter in the bucket, padded to the largest rank's
size P, so a reduce-scatter hands each rank exactly its rows and an all-gather of the updated rows
restores every parameter. Buckets follow reversed named_parameters order (roughly the order backward
finishes gradients) and are always launched in index order on every rank, so collectives pair up
and summation is deterministic. Stage 1 all-reduces a bucket (every rank keeps full gradients);
stage 2 reduce-scatters it and frees the full gradients of its parameters.

Overlap. A post-accumulate-grad hook counts each parameter's gradient accumulations. The first step
only counts (backward runs once per microbatch and chunk; the chunks are the optimizer's to learn)
and divides by that step's microbatch count, which the trainer hands over before every step
(set_microbatches; a dynamic batch moves it between steps). From then on a bucket's async collective
fires when all its parameters reached (accumulations per microbatch) x (this step's microbatches),
i.e. during the last microbatch's backward, never earlier. Gradients that sync_model_parallel_grads still has
to change (tp-partial, the tied embedding split over pp) go in "late" buckets launched after that
sync in reduce_grads. A step whose backward count exceeds the expected one raises (a bucket would
already have been reduced from an incomplete gradient): more backward passes than the microbatches
the optimizer was told.

Clipping. The norm is computed once from each rank's gradient rows: summed over dp, over tp for
tp-sharded parameters only, and over pp; the tied head copy on the last stage is skipped.

Shapes: a parameter's local shape is (R, ...) with R rows; its shard (R_r, ...) for rank r; a bucket
is flat (dp * P,).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from pipetrain.config import TrainConfig
from pipetrain.models.init import param_layout
from pipetrain.optim.adamw import ReadBox, decays, is_tied, set_lr, step_adamw
from pipetrain.optim.torch_opt import (build_torch_opt, load_torch_opt_state, torch_opt_state_bytes,
                                       torch_opt_state_items)
from pipetrain.parallel.mesh.comm import all_gather_async, all_reduce_async, reduce_scatter_async
from pipetrain.parallel.data.allreduce import DEFAULT_BUCKET_BYTES
from pipetrain.parallel.data.flat import copy_back_, flatten
from pipetrain.parallel.data.grads import (clip_coefficient, global_grad_norm, global_grad_norm_tensor,
                                           is_tp_replicated, model_parallel_synced_params, step_on_device, sum_sq,
                                           sync_model_parallel_grads, tied_copy_names)

# Buckets whose reduction may be in flight at once: each holds a (dp * P,) buffer until finished, so
# this bounds the transient memory of the reduction to about two buckets (the launch that exceeds it
# waits for the oldest, inside backward when overlapping).
MAX_IN_FLIGHT = 2


def dp_row_ranges(num_rows: int, dp_size: int) -> list[tuple[int, int]]:
    """[start, end) rows of each dp rank, as torch.tensor_split(x, dp_size) splits dim 0."""
    base, extra = divmod(num_rows, dp_size)
    out, start = [], 0
    for r in range(dp_size):
        end = start + base + (1 if r < extra else 0)
        out.append((start, end))
        start = end
    return out


@dataclass(frozen=True)
class ParamShard:
    """Where one parameter's local tensor and its dp row shards sit in the global tensor."""
    name: str                              # global parameter name
    global_shape: tuple[int, ...]
    local_offsets: tuple[int, ...]         # the tp slice's offsets in the global tensor
    local_shape: tuple[int, ...]
    rows: tuple[tuple[int, int], ...]      # [start, end) of local dim 0, per dp rank

    @property
    def row_numel(self) -> int:
        n = 1
        for s in self.local_shape[1:]:
            n *= s
        return n

    def numel(self, dp_rank: int) -> int:
        start, end = self.rows[dp_rank]
        return (end - start) * self.row_numel

    def box(self, dp_rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, shape) of dp_rank's shard in the global tensor."""
        start, end = self.rows[dp_rank]
        return (self.local_offsets[0] + start,) + self.local_offsets[1:], (end - start,) + self.local_shape[1:]


@dataclass
class _Bucket:
    members: list[int]                     # indices into ZeroOptimizer.params
    starts: list[list[int]]                # starts[r][j]: offset of member j's rows in rank r's part
    part: int                              # per-rank part size P (the largest rank's, others padded)
    late: bool                             # launched only after sync_model_parallel_grads
    ready: int = 0                         # members whose gradient is final this step
    flat: Optional[torch.Tensor] = field(default=None, repr=False)
    out: Optional[torch.Tensor] = field(default=None, repr=False)
    work: Optional[object] = field(default=None, repr=False)


class ZeroOptimizer:
    """AdamW with state sharded across dims.dp_group (stage 1) and gradients too (stage 2).

    Same interface as pipetrain.optim.build.Optimizer: zero_grad(); backward...; reduce_grads();
    clip_grad_norm(max_norm) -> global norm; step(lr); plus state_items / load_state_items.
    """

    def __init__(self, model: nn.Module, dims, cfg: TrainConfig, stage: int,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = True, owns=None, shard_over=None,
                 sync_model_parallel: bool = True):
        """owns(param) -> bool: the parameters this optimizer updates (None: all); shard_over: (size, rank,
        group) to shard over instead of dp_shard; sync_model_parallel: reduce_grads first syncs tp-partial
        and tied gradients (an expert-parallel run's second optimizer leaves that to the first)."""
        if stage not in (1, 2, 3):  # 3: pipetrain.parallel.data.zero3.Zero3Optimizer, which adds the gathering
            raise ValueError(f"ZeroOptimizer: stage must be 1, 2 or 3, got {stage}; use "
                             "pipetrain.optim.build.Optimizer for parallel.zero=0")
        if dims.zero_shard > 1 and dims.zero_shard_group is None:
            raise ValueError(f"{dims.coords} ZeroOptimizer: shards over {dims.zero_shard} ranks but dims has no "
                             "dp_shard / dp_cp group; build dims with "
                             "ParallelDims.init / from_degrees after init_process_group")
        self.model, self.dims, self.cfg, self.stage, self.overlap = model, dims, cfg, stage, overlap
        # ZeRO shards over dp_shard (= dp unless parallel.dp_shard splits off replicas), times cp under context
        # parallelism (dims.zero_shard says why); "dp" below names that shard group. shard_over: another
        # (size, rank, group), expert parallelism's expert-dp group for the experts' states
        self.dp_size, self.dp_rank, self.dp_group = shard_over or (dims.zero_shard, dims.zero_shard_rank,
                                                                   dims.zero_shard_group)
        self.sync_model_parallel = sync_model_parallel
        layout = param_layout(model)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and (owns is None or owns(p))]
        self.params = [p for _, p in named]
        self.shards = [self._param_shard(name, p, layout) for name, p in named]
        late = {id(p) for p in model_parallel_synced_params(model, dims)}
        self.buckets = self._build_buckets(bucket_bytes, late)
        self._bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket.members}
        self.num_early = sum(not b.late for b in self.buckets)

        # AdamW over views of this rank's rows (empty shards are left out: they own nothing).
        self.views: dict[int, nn.Parameter] = {}
        groups = [{"params": [], "weight_decay": cfg.weight_decay}, {"params": [], "weight_decay": 0.0}]
        for i, ((name, p), shard) in enumerate(zip(named, self.shards)):
            if shard.numel(self.dp_rank):
                self.views[i] = nn.Parameter(self._rows(p.detach(), i))
                groups[0 if decays(name, p, is_tied(model)) else 1]["params"].append(self.views[i])
        self.torch_opt = build_torch_opt(groups, cfg)
        self.steps_taken = 0
        self._microbatches: Optional[int] = None  # this step's, from set_microbatches (None: never told, 1)
        self._per_microbatch: Optional[list[int]] = None  # accumulations per parameter per microbatch, step 1
        self._expected: Optional[list[int]] = None  # accumulations per parameter this step
        self._counts = [0] * len(self.params)
        self._next_launch = 0
        self._in_flight: list[_Bucket] = []  # launched, not yet finished, in launch order
        self._grad_shards: dict[int, torch.Tensor] = {}  # this rank's gradient rows, set by reduce_grads
        self._grad_buffers: list[torch.Tensor] = []  # stage 2: the tensors those rows live in
        self._had_grad: dict[int, bool] = {}  # stage 2: whether a parameter had a gradient when reduced
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(self._make_hook(i))

    # ---- layout ----
    def _param_shard(self, name: str, p: torch.Tensor, layout) -> ParamShard:
        """Where p (global name, param_layout's entry in layout) and its dp row shards sit."""
        shape, slices = layout[name]
        if p.dim() == 0:
            raise ValueError(f"ZeroOptimizer: parameter {name} is a scalar; ZeRO shards along dim 0")
        return ParamShard(name, tuple(shape), tuple(s.start or 0 for s in slices), tuple(p.shape),
                          tuple(dp_row_ranges(p.shape[0], self.dp_size)))

    def _rows(self, t: torch.Tensor, i: int, dp_rank: int | None = None) -> torch.Tensor:
        start, end = self.shards[i].rows[self.dp_rank if dp_rank is None else dp_rank]
        return t[start:end]

    def _build_buckets(self, bucket_bytes: int, late: set[int]) -> list[_Bucket]:
        order = list(range(len(self.params)))[::-1]
        buckets = []
        for is_late in (False, True):
            current, size = [], 0
            for i in order:
                p = self.params[i]
                if (id(p) in late) != is_late:
                    continue
                nbytes = p.numel() * p.element_size()
                if current and (size + nbytes > bucket_bytes or p.dtype != self.params[current[0]].dtype):
                    buckets.append(self._new_bucket(current, is_late))
                    current, size = [], 0
                current.append(i)
                size += nbytes
            if current:
                buckets.append(self._new_bucket(current, is_late))
        return buckets

    def _placed(self, bucket: _Bucket, tensor_of, ranks, rank_major: bool = True):
        """(pieces, offsets) for pipetrain.parallel.data.flat: ranks' rows of tensor_of(i) for every member
        (None where tensor_of gives None), at their place in the bucket's rank-major (dp * P,) buffer, or
        (rank_major False, one rank) in that rank's (P,) part."""
        pieces, offsets = [], []
        for r in ranks:
            base = r * bucket.part if rank_major else 0
            for j, i in enumerate(bucket.members):
                t = tensor_of(i)
                pieces.append(None if t is None else self._rows(t, i, r))
                offsets.append(base + bucket.starts[r][j])
        return pieces, offsets

    def _new_bucket(self, members: list[int], late: bool) -> _Bucket:
        starts, sizes = [], []
        for r in range(self.dp_size):
            offsets, offset = [], 0
            for i in members:
                offsets.append(offset)
                offset += self.shards[i].numel(r)
            starts.append(offsets)
            sizes.append(offset)
        return _Bucket(members, starts, max(sizes), late)

    # ---- gradient reduction ----
    def _make_hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            self._counts[i] += 1
            if not self.overlap or self._expected is None:
                return
            if self._counts[i] > self._expected[i]:
                raise RuntimeError(f"{self.dims.coords} ZeroOptimizer: gradient of {self.shards[i].name} accumulated "
                                   f"{self._counts[i]} times this step but {self._expected[i]} times were expected "
                                   f"({self._microbatches or 1} microbatch(es)), and its bucket was already "
                                   "reduced; call set_microbatches(k) with the step's microbatch count before its "
                                   "backward, or build the optimizer with overlap=False")
            bucket = self.buckets[self._bucket_of[i]]
            if self._counts[i] == self._expected[i] and not bucket.late:
                bucket.ready += 1
                while self._next_launch < self.num_early and \
                        self.buckets[self._next_launch].ready == len(self.buckets[self._next_launch].members):
                    self._launch(self.buckets[self._next_launch])
                    self._next_launch += 1
        return hook

    def _launch(self, bucket: _Bucket) -> None:
        """Copy the members' gradients rank-major into a flat buffer and start its dp reduction."""
        P = bucket.part
        dtype, device = self._grad_dtype(bucket.members[0]), self.params[bucket.members[0]].device
        # a member with no gradient on any dp rank (same graph) reduces zeros and the step skips it;
        # padding is reduced like the rest and never read
        pieces, offsets = self._placed(bucket, self._grad, range(self.dp_size))
        flat = flatten(pieces, device, offsets=offsets, size=self.dp_size * P, dtype=dtype)  # (dp * P,)
        bucket.flat = flat
        self._in_flight.append(bucket)
        if self.stage == 1:
            bucket.work = all_reduce_async(flat, self.dp_group)
        else:
            bucket.out = torch.empty(P, dtype=dtype, device=device)
            bucket.work = reduce_scatter_async(bucket.out, flat, self.dp_group)
        if self.stage >= 2:
            for i in bucket.members:
                self._had_grad[i] = self._grad(i) is not None
                self._drop_grad(i)  # stages 2 and 3 keep only their rows, in bucket.out
        while len(self._in_flight) > MAX_IN_FLIGHT:  # bound the flat buffers alive at once
            self._finish(self._in_flight.pop(0))

    def _grad(self, i: int) -> Optional[torch.Tensor]:
        """Parameter i's accumulated gradient this step (ZeRO-3 keeps a bf16 weight's apart, in fp32)."""
        return self.params[i].grad

    def _grad_dtype(self, i: int) -> torch.dtype:
        """The dtype parameter i's gradient is reduced in: its master's."""
        return self.params[i].dtype

    def _drop_grad(self, i: int) -> None:
        self.params[i].grad = None

    def _finish(self, bucket: _Bucket) -> None:
        """Wait for a bucket's reduction and point this rank's gradient shards at the result."""
        bucket.work.wait()
        me = self.dp_rank
        if self.stage == 1:
            copy_back_(bucket.flat, *self._placed(bucket, lambda i: self.params[i].grad, range(self.dp_size)))
            for i in bucket.members:
                grad = self.params[i].grad
                if grad is not None and i in self.views:
                    self._grad_shards[i] = self._rows(grad, i)
        else:
            mine = bucket.out  # (P,)
            self._grad_buffers.append(mine)
            for j, i in enumerate(bucket.members):
                if i in self.views and self._had_grad[i]:
                    start = bucket.starts[me][j]
                    self._grad_shards[i] = mine[start:start + self.shards[i].numel(me)].view(
                        self.views[i].shape)
        bucket.flat = bucket.out = bucket.work = None

    def set_microbatches(self, num_microbatches: int) -> None:
        """This step's microbatch count (before its backward): the overlapped reduction launches a bucket
        once each member has accumulated this many microbatches' gradients."""
        if num_microbatches < 1:
            raise ValueError(f"{self.dims.coords} ZeroOptimizer.set_microbatches: a step runs at least one "
                             f"microbatch, got {num_microbatches}")
        self._microbatches = num_microbatches
        if self._per_microbatch is not None:
            self._expected = [c * num_microbatches for c in self._per_microbatch]

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            if bucket.work is not None:  # a step that failed mid-reduction: drain before reuse
                bucket.work.wait()
            bucket.ready, bucket.flat, bucket.out, bucket.work = 0, None, None, None
        self._in_flight = []
        self.model.zero_grad(set_to_none=True)
        self._counts = [0] * len(self.params)
        self._next_launch = 0
        self._grad_shards, self._grad_buffers, self._had_grad = {}, [], {}

    def reduce_grads(self) -> None:
        """Finish the dp reduction: launch buckets the hooks did not, after the model-parallel sync for
        late buckets; afterwards each rank holds its gradient rows of every parameter."""
        for b in range(self._next_launch, self.num_early):
            self._launch(self.buckets[b])
        self._next_launch = self.num_early
        if self.sync_model_parallel:
            sync_model_parallel_grads(self.model, self.dims)
        for bucket in self.buckets[self.num_early:]:
            self._launch(bucket)
        while self._in_flight:
            self._finish(self._in_flight.pop(0))
        if self._per_microbatch is None:
            self._learn_counts()

    def _learn_counts(self) -> None:
        """After the first step: accumulations per parameter per microbatch, from that step's counts."""
        k = self._microbatches or 1
        if any(c % k for c in self._counts):
            # a parameter's backward count is not a whole number per microbatch (a caller that runs
            # backward outside the schedule): no count to expect, so reduce every bucket after backward
            self.overlap = False
        self._per_microbatch = [c // k for c in self._counts]
        self._expected = list(self._counts)

    # ---- clipping and the update ----
    def clip_grad_norm(self, max_norm: float) -> float:
        """Global gradient L2 norm from every rank's rows; scales the rows in place above max_norm > 0."""
        sharded, replicated = self.grad_sq_sums()
        norm = global_grad_norm(sharded, replicated, self.dims, dp_sharded=True, shard_group=self.dp_group,
                                extra_sq=getattr(self, "extra_grad_sq", 0.0))
        coef = clip_coefficient(norm, max_norm)
        if coef is not None:
            self.scale_grads(coef)
        return norm

    @property
    def steps_on_device(self) -> bool:
        """As pipetrain.optim.build.Optimizer's: a fused AdamW over the rows clips and checks on the device."""
        return bool(self.torch_opt.defaults.get("fused"))

    def clip_and_step(self, max_norm: float, lr: float, loss_sum: torch.Tensor) -> torch.Tensor:
        """clip_grad_norm + step(lr) with no host read (grads.step_on_device); returns the norm on the device."""
        norm = global_grad_norm_tensor(*self.grad_sq_sums(), self.dims, dp_sharded=True, shard_group=self.dp_group)
        step_on_device([self.torch_opt], lambda: self.step(lr), norm, max_norm, loss_sum)
        return norm

    def grad_sq_sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of squares over tp-sharded, over tp-replicated) of this rank's gradient rows."""
        skip = tied_copy_names(self.model)
        sharded, replicated = [], []
        for i in sorted(self._grad_shards):  # parameter order, as zero 0 sums: same norm to the last bit
            grad, shard = self._grad_shards[i], self.shards[i]
            if shard.name not in skip:
                kind = replicated if is_tp_replicated(shard.global_shape, shard.local_shape) else sharded
                kind.append(grad.detach())
        device = self.dims.device  # (an expert part under LoRA owns no trainable parameter: no params[0])
        return sum_sq(sharded, device), sum_sq(replicated, device)

    def scale_grads(self, coef: float) -> None:
        """Multiply the gradients by coef (clipping)."""
        if self.stage == 1:  # scale the full gradients, so p.grad matches zero 0 after clipping too
            grads = [p.grad for p in self.params if p.grad is not None]
        else:
            grads = list(self._grad_shards.values())
        if grads:  # a rank may hold no rows (expert weights of fewer rows than expert-dp (x cp) ranks)
            torch._foreach_mul_(grads, coef)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """AdamW on this rank's rows (torch.optim.AdamW's own math), then all-gather the updated rows."""
        set_lr(self.torch_opt, lr)
        self._bind_views()
        for i, view in self.views.items():
            view.grad = self._grad_shards.get(i)
        step_adamw(self.torch_opt)
        for view in self.views.values():
            view.grad = None
        self.steps_taken += 1
        self._all_gather_params()

    def _bind_views(self) -> None:
        """Re-point the AdamW views at the parameters' rows: parameters may have been reloaded."""
        for i, view in self.views.items():
            view.data = self._rows(self.params[i].detach(), i)

    def _all_gather_params(self) -> None:
        if self.dp_size == 1:
            return
        in_flight: list[tuple[_Bucket, torch.Tensor, object]] = []
        for bucket in self.buckets:
            p0 = self.params[bucket.members[0]]
            flat = torch.empty(self.dp_size * bucket.part, dtype=p0.dtype, device=p0.device)  # (dp * P,)
            pieces, offsets = self._placed(bucket, lambda i: self.params[i].detach(), [self.dp_rank], rank_major=False)
            mine = flatten(pieces, p0.device, offsets=offsets, size=bucket.part, dtype=p0.dtype)  # (P,)
            in_flight.append((bucket, flat, all_gather_async(flat, mine, self.dp_group)))
            if len(in_flight) > 1:  # keep at most two buckets' buffers alive
                self._scatter_rows(*in_flight.pop(0))
        for args in in_flight:
            self._scatter_rows(*args)

    def _scatter_rows(self, bucket: _Bucket, flat: torch.Tensor, work) -> None:
        work.wait()
        others = [r for r in range(self.dp_size) if r != self.dp_rank]
        copy_back_(flat, *self._placed(bucket, lambda i: self.params[i].detach(), others))

    # ---- checkpoints and accounting ----
    def _entries(self, include_tied_copy: bool):
        skip = set() if include_tied_copy else tied_copy_names(self.model)
        out = []
        for i, view in self.views.items():
            shard = self.shards[i]
            if shard.name not in skip:
                offsets, _ = shard.box(self.dp_rank)
                out.append((shard.name, view, shard.global_shape, offsets))
        return out

    def state_items(self) -> list[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
        """(name, local tensor, global shape, offsets) of every optimizer tensor this rank owns:
        "exp_avg/<name>" and "exp_avg_sq/<name>" for its non-empty row shards, and the scalar "step".
        The tied head copy on the last stage is left out (the first stage's embed.weight entries
        hold the same values)."""
        return torch_opt_state_items(self.torch_opt, self._entries(include_tied_copy=False), self.steps_taken)

    def load_state_items(self, read: ReadBox) -> None:
        """Load this rank's row shards of every moment; the tied head copy reads embed.weight's."""
        self.steps_taken = load_torch_opt_state(self.torch_opt, self._entries(include_tied_copy=True), read,
                                                is_tied(self.model))

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (its rows of the AdamW moments)."""
        return torch_opt_state_bytes(self.torch_opt)

    def grad_bytes(self) -> int:
        """Bytes of gradient this rank holds now (after reduce_grads: full at stage 1, its rows plus
        bucket padding at stage 2)."""
        held = sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)
        return held + sum(t.numel() * t.element_size() for t in self._grad_buffers)
