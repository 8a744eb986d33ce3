"""ZeRO-3's units: the modules whose parameters are gathered together, and the hooks that gather and free them
(pipetrain/parallel/data/zero3.py holds the rows, the gradients and the optimizer).

Units. The model stays blind: UnitGatherer wraps the stage's modules from outside, in forward order:
the input embedding (with gpt2's position embedding), each transformer block, and the final norm with
the head.
- forward: a pre-hook gathers the unit (waiting for its prefetch) and starts the next unit's gather
  asynchronously, so that communication overlaps this unit's compute (only the next unit in the whole
  model: a rank's pipeline chunks, interleaved or in a V, run in the schedule's order, not the model's);
  a post-hook frees the unit unless parallel.reshard_after_forward is false (then units stay gathered until the step's gradients are
  reduced: pipeline stages run each unit once per microbatch). Without autograd (evaluation) units are
  always freed after their forward.
- backward: the post-hook wraps the unit's output in _Regather, an identity whose backward runs before the
  unit's own backward nodes: it frees every other gathered unit (the unit after this one has finished its
  backward: the gradient reaching this output is complete), gathers this unit and prefetches the one before.
  It saves no tensor. Recomputation re-runs the forward inside the unit's backward, after the gather. A
  deferred weight gradient (parallel.split_backward, zbv) needs only the saved input and output gradient,
  so its W action runs with the unit freed; the reduce-scatter counts accumulations, so it waits for the
  last dW.
- frozen parameters (LoRA's base) are sharded and gathered like the rest but have no bucket, hook or AdamW
  state; a unit whose output needs no gradient (a frozen embedding) is never gathered in backward, and
  neither is the embedding unit: a lookup's backward adds rows of the output gradient at the ids (its
  weight gradient is reduce-scattered like any other) and reads no weight.
- a module read without its forward running (train.fused_loss applies the head's weight in the loss) is
  gathered around that call by call_outside, which handles the call's output as the post-hook would.
- every pass is logged to self.events when a list is set there (benchmarks/zero3.py --timeline).
At most two units are gathered (or being gathered) at once with reshard_after_forward; UnitGatherer
counts them (peak_gathered) so tests can assert it.

A gatherer gathers only its optimizer's parameters. Under expert parallelism (parallel/expert/zero.py) two
gatherers hook the same modules: the non-experts' over dp and the experts' over expert-dp (the blocks with
experts only). Their hooks run in registration order on every rank, so each group's collectives pair up.

Freeing. A unit's parameters live in storages of their own (copied at construction if a parameter shares
one); freeing resizes the storage to zero bytes, gathering resizes it back and copies the rows in, so
tensors autograd saved in forward (the weights of a linear) see the gathered values again in backward.
A parameter shared by two units (a tied embedding on a single stage) stays allocated while either is.

fp8 weights (train.precision=fp8, zero3.py) are gathered quantised into their Fp8Weight (target), not into
the parameter, through a uint8 view (a gather moves bytes; not every backend takes float8 dtypes).

Shapes: a unit's gather buffers are flat (dp * P,), one per dtype: part r holds rank r's rows of every member of
that dtype, P the largest rank's size (ZeroOptimizer's bucket layout).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from pipetrain.parallel.data.flat import copy_back_, flatten
from pipetrain.parallel.data.zero import _Bucket
from pipetrain.parallel.mesh.comm import all_gather_async
from pipetrain.parallel.tensor.fp8 import FORWARD_DTYPE, quantize
from pipetrain.parallel.tensor.layers import VocabParallelEmbedding

EMBEDDINGS = (nn.Embedding, VocabParallelEmbedding)  # a lookup's backward scatters into rows: it reads no weight


@dataclass
class _Unit:
    name: str
    position: int                          # in the whole model: embed -1, block i at i, head n_layers
    modules: list[nn.Module]               # in forward order: pre-hook on the first, post-hook on the last
    layouts: list[_Bucket]                 # per dtype: members (indices into ZeroOptimizer.params), rank-major places
    flats: list[torch.Tensor] = field(default_factory=list, repr=False)  # (dp * P,) each while gathers are in flight
    works: list[object] = field(default_factory=list, repr=False)
    prefetched_by: Optional[tuple[str, int]] = None  # (phase, unit) whose hook started the gather in flight
    gathered: bool = False
    reads_weights_in_backward: bool = True  # False for the embedding unit: its backward reads the ids only
    has_backward: bool = True              # its last forward's output needed a gradient (not so for a frozen
                                           # embedding under LoRA) and it reads_weights_in_backward: only then
                                           # does backward gather it

    @property
    def members(self) -> list[int]:
        return [i for layout in self.layouts for i in layout.members]


def stage_units(model: nn.Module) -> list[tuple[str, int, list[nn.Module]]]:
    """(name, position in the whole model, modules) of this stage's units in forward order: embedding (+ position
    embedding) at -1, block i at i, final norm + head at n_layers; a module pipeline parallelism removed (None)
    is left out."""
    units = []
    first = [m for m in (getattr(model, "embed", None), getattr(model, "pos_embed", None)) if m is not None]
    if first:
        units.append(("embed", -1, first))
    for name, block in model.layers.items():
        units.append((f"layers.{name}", int(name), [block]))
    last = [m for m in (getattr(model, "norm", None), getattr(model, "head", None)) if m is not None]
    if last:
        units.append(("head", model.cfg.n_layers, last))
    return units


class _Regather(torch.autograd.Function):
    """forward: identity; backward: gather the unit (freeing the others) before its backward nodes run."""

    @staticmethod
    def forward(ctx, x, gatherer, index):
        ctx.gatherer, ctx.index = gatherer, index
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        ctx.gatherer.before_backward(ctx.index)
        return dy, None, None


class UnitGatherer:
    """The forward / backward hooks that gather a unit's parameters from the dp ranks' rows and free them."""

    def __init__(self, opt, model: nn.Module, reshard_after_forward: bool):  # opt: the Zero3Optimizer
        self.opt, self.reshard = opt, reshard_after_forward
        index = {id(p): i for i, p in enumerate(opt.params)}
        self.units: list[_Unit] = []
        seen: set[int] = set()
        for name, position, modules in stage_units(model):
            # the optimizer's parameters only (expert parallelism: the experts' optimizer gathers their blocks
            # over expert-dp, the other's the rest over dp); a unit with none of them is not this gatherer's
            members = sorted({index[id(p)] for m in modules for p in m.parameters() if id(p) in index})
            if not members:
                continue
            seen.update(members)
            dtypes = sorted({opt.gather_dtype(i) for i in members}, key=str)
            layouts = [opt._new_bucket([i for i in members if opt.gather_dtype(i) == dtype], late=False)
                       for dtype in dtypes]
            reads = not all(isinstance(m, EMBEDDINGS) for m in modules)
            self.units.append(_Unit(name, position, modules, layouts, reads_weights_in_backward=reads))
        missing = [opt.shards[i].name for i in range(len(opt.params)) if i not in seen]
        assert not missing, f"UnitGatherer: parameters outside every unit: {missing}"
        self._home_rows()
        for p in opt.params:  # storage of its own, so that freeing it frees nothing else
            storage = p.untyped_storage()
            if p.storage_offset() or storage.nbytes() != p.numel() * p.element_size():
                p.data = p.data.clone()
        self.scales_stale = True  # fp8 weights' scales must be computed before their next gather
        self.num_gathered = 0  # units gathered or being gathered now
        self.peak_gathered = 0  # the most at once since reset_peak
        self.gathers = 0  # unit gathers started
        self.collectives = 0  # all-gathers they issued (one per dtype in the unit)
        self.gathered_bytes: dict[torch.dtype, int] = {}  # bytes those received, by dtype
        self.unused_prefetches = 0  # of them, freed before any pass waited for them
        # (phase, unit) whose prefetch of its neighbour was once unused: the schedule runs another chunk next
        self._no_prefetch: set[tuple[str, int]] = set()
        # the timeline (benchmarks/zero3.py --timeline): None, or a list the hooks append (time, event, unit) to
        self.events: Optional[list[tuple[float, str, int]]] = None
        # all-gathers started per unit, by the pass that started them (a prefetch counts for the pass it serves)
        self.unit_gathers = {"forward": [0] * len(self.units), "backward": [0] * len(self.units)}
        for k, unit in enumerate(self.units):
            unit.modules[0].register_forward_pre_hook(self._pre_hook(k))
            unit.modules[-1].register_forward_hook(self._post_hook(k))

    def _home_rows(self) -> None:
        """Move each layout's rows into one flat (P,) buffer in its gather order (the rows become views of it,
        in place: AdamW and the checkpoints keep their tensors), so a gather sends that buffer as it is (or
        one cast of it to bf16) instead of copying every row into a new one. A parameter in two units (a
        tied embedding on one stage) lives in the first; the second layout copies its rows at each gather."""
        opt, homed = self.opt, set()
        self._row_buffers: dict[int, torch.Tensor] = {}  # id(layout) -> (P,) buffer
        for unit in self.units:
            for layout in unit.layouts:
                if homed.intersection(layout.members):
                    continue
                i0 = layout.members[0]
                buf = torch.zeros(layout.part, dtype=opt._master_dtype[i0], device=opt.params[i0].device)
                with torch.no_grad():
                    for j, i in enumerate(layout.members):
                        rows = opt.rows.get(i)
                        if rows is None:  # no rows on this rank
                            continue
                        start = layout.starts[opt.dp_rank][j]
                        piece = buf[start:start + rows.numel()].view(rows.shape)
                        piece.copy_(rows)
                        rows.data = piece
                homed.update(layout.members)
                self._row_buffers[id(layout)] = buf

    # ---- hooks ----
    def _pre_hook(self, k: int):
        def hook(module, args):
            if self.reshard:  # only this unit and the next are kept
                for j, unit in enumerate(self.units):
                    if j not in (k, k + 1):
                        self._free(j)
            self._wait(k, "forward")
            if self._adjacent(k, k + 1) and ("forward", k) not in self._no_prefetch:
                self._start(k + 1, "forward", prefetched_by=k)
            self._log("forward", k)
        return hook

    def _post_hook(self, k: int):
        def hook(module, args, output):
            self._log("forward_end", k)
            if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor) or not output.requires_grad:
                self.units[k].has_backward = not torch.is_grad_enabled()  # evaluation says nothing of training
                self._free(k)
                return None
            unit = self.units[k]
            unit.has_backward = unit.reads_weights_in_backward
            if self.reshard:
                self._free(k)
            return _Regather.apply(output, self, k) if unit.has_backward else None
        return hook

    def call_outside(self, module: nn.Module, fn, *args):
        """fn(*args), which reads module's parameters where module's own forward does not run (train.fused_loss
        applies the head's weight inside the loss): module's unit is gathered around the call, and fn's output
        is handled as the unit's post-hook handles a forward's output, so the unit is freed (with
        reshard_after_forward) and backward gathers it again before fn's backward reads the weight."""
        k = next(j for j, unit in enumerate(self.units) if any(m is module for m in unit.modules))
        self._wait(k, "forward")
        out = fn(*args)
        wrapped = self._post_hook(k)(module, args, out)
        return out if wrapped is None else wrapped

    def before_backward(self, k: int) -> None:
        if self.reshard:
            for j in range(len(self.units)):
                if j not in (k, k - 1):
                    self._free(j)
        self._wait(k, "backward")
        if self._adjacent(k - 1, k) and self.units[k - 1].has_backward and ("backward", k) not in self._no_prefetch:
            self._start(k - 1, "backward", prefetched_by=k)
        self._log("backward", k)

    def _adjacent(self, j: int, k: int) -> bool:
        """Whether unit k follows unit j in the whole model. A rank's pipeline chunks run in the schedule's order,
        so a prefetch across an interleaved chunk boundary would gather a unit that runs later; the V placement's
        rank pp - 1 holds two adjacent stages, and a prefetch between them that went unused is not repeated
        (_no_prefetch)."""
        return 0 <= j and k < len(self.units) and self.units[k].position == self.units[j].position + 1

    def _log(self, event: str, k: int) -> None:
        """Record an event when a timeline is kept: "gather <pass>" (issued for a forward or backward pass, or
        "gather " outside one), wait / gathered (the wait for it ends),
        forward / backward (unit k's compute starts), forward_end, and done (at any of those or a wait, a gather
        in flight found already complete: it ran behind compute)."""
        if self.events is None:
            return
        now = time.perf_counter()
        if event in ("forward", "forward_end", "backward", "wait"):
            for j, unit in enumerate(self.units):
                if unit.works and all(work.is_completed() for work in unit.works):
                    self.events.append((now, "done", j))
        self.events.append((now, event, k))

    # ---- gathering and freeing ----
    def _count(self, delta: int) -> None:
        self.num_gathered += delta
        self.peak_gathered = max(self.peak_gathered, self.num_gathered)

    @torch.no_grad()
    def _start(self, k: int, phase: str = "", prefetched_by: int | None = None) -> None:
        """Start the all-gather of unit k's rows (nothing when gathered or already started)."""
        unit = self.units[k]
        if unit.gathered or unit.works:
            return
        if self.scales_stale and any(i in self.opt.fp8_weights for i in unit.members):
            self.opt.fp8_scales()  # every rank gathers its units in the same order: all reach this together
            self.scales_stale = False
        for layout in unit.layouts:
            flat, work = self._all_gather(layout, self.opt.gather_dtype(layout.members[0]))
            unit.flats.append(flat)
            unit.works.append(work)
        unit.prefetched_by = None if prefetched_by is None else (phase, prefetched_by)
        self._log(f"gather {phase}", k)
        self.gathers += 1
        if phase:
            self.unit_gathers[phase][k] += 1
        self._count(1)

    def _all_gather(self, layout: _Bucket, dtype: torch.dtype, count: bool = True) -> tuple[torch.Tensor, object]:
        """Start gathering every rank's rows of layout's members, rounded to dtype: ((dp * P,) buffer, work);
        count: into collectives and gathered_bytes (training's gathers, not full_params')."""
        opt = self.opt
        device = opt.params[layout.members[0]].device
        mine = self._row_buffers.get(id(layout))  # (P,)
        if dtype == FORWARD_DTYPE:  # fp8 weights: each one's rows quantised with its whole weight's scale
            mine = self._quantized_rows(layout)
        elif mine is None:
            pieces = [opt.rows.get(i) for i in layout.members]
            offsets = [layout.starts[opt.dp_rank][j] for j in range(len(layout.members))]
            mine = flatten(pieces, device, offsets=offsets, size=layout.part, dtype=dtype)
        elif mine.dtype != dtype:
            mine = mine.to(dtype)
        flat = torch.empty(opt.dp_size * layout.part, dtype=dtype, device=device)  # (dp * P,)
        if count:
            self.collectives += 1
            self.gathered_bytes[dtype] = self.gathered_bytes.get(dtype, 0) + flat.numel() * flat.element_size()
        if dtype == FORWARD_DTYPE:  # bytes: not every backend reduces float8, and a gather only moves bytes
            return flat, all_gather_async(flat.view(torch.uint8), mine.view(torch.uint8), opt.dp_group)
        return flat, all_gather_async(flat, mine, opt.dp_group)

    def _quantized_rows(self, layout: _Bucket) -> torch.Tensor:
        """(P,) float8_e4m3fn: this rank's rows of layout's fp8 weights, each quantised with its Fp8Weight's
        scale, at their places in the gather buffer."""
        opt = self.opt
        out = torch.zeros(layout.part, dtype=FORWARD_DTYPE, device=opt.params[layout.members[0]].device)
        for j, i in enumerate(layout.members):
            rows = opt.rows.get(i)
            if rows is not None:
                start = layout.starts[opt.dp_rank][j]
                out[start:start + rows.numel()] = quantize(rows.reshape(-1), opt.fp8_weights[i].scale, FORWARD_DTYPE)
        return out

    def target(self, i: int) -> torch.Tensor:
        """The tensor a gather fills for parameter i: the parameter, or an fp8 linear's Fp8Weight data."""
        holder = self.opt.fp8_weights.get(i)
        return self.opt.params[i] if holder is None else holder.data

    def _wait(self, k: int, phase: str = "") -> None:
        """Finish unit k's gather (starting it first if needed) and copy the rows into its parameters."""
        unit, opt = self.units[k], self.opt
        if unit.gathered:
            return
        self._start(k, phase)
        # no autograd: gloo's all-gather writes its output through views made without grad, which a wait
        # under grad mode (a forward hook) refuses
        with torch.no_grad():
            self._log("wait", k)
            for work in unit.works:
                work.wait()
            self._log("gathered", k)
            for layout, flat in zip(unit.layouts, unit.flats):
                for i in layout.members:
                    t = self.target(i)
                    t.untyped_storage().resize_(t.numel() * t.element_size())
                # through .data, whose version counter is its own: the weights autograd saved in forward must
                # not look modified in place when backward gathers them again
                copy_back_(flat, *opt._placed(layout, lambda i: self.target(i).data, range(opt.dp_size)))
        unit.flats, unit.works = [], []
        unit.gathered = True

    def _free(self, k: int) -> None:
        unit = self.units[k]
        if unit.works:  # a prefetch nobody used: finish it so its buffers can go
            self.unused_prefetches += 1
            self._no_prefetch.add(unit.prefetched_by)
            with torch.no_grad():
                for work in unit.works:
                    work.wait()
            unit.flats, unit.works = [], []
            self._count(-1)
            return
        if not unit.gathered:
            return
        kept = {i for j, other in enumerate(self.units) if j != k and other.gathered for i in other.members}
        for i in unit.members:
            if i not in kept:
                self.target(i).untyped_storage().resize_(0)
        unit.gathered = False
        self._count(-1)

    def free_all(self) -> None:
        for k in range(len(self.units)):
            self._free(k)
        if self.num_gathered == 0:  # storage a constructor filled (materialize, a load) goes too
            for i, p in enumerate(self.opt.params):
                p.untyped_storage().resize_(0)
                self.target(i).untyped_storage().resize_(0)

    @torch.no_grad()
    def full_params(self) -> dict[str, torch.Tensor]:
        """A copy of every parameter's whole local tensor in its master dtype (the rows as they are, not rounded
        to a bf16 weight's), one unit at a time, for inspection."""
        opt, out = self.opt, {}
        for unit in self.units:
            for layout in unit.layouts:
                dtype = opt._master_dtype[layout.members[0]]
                flat, work = self._all_gather(layout, dtype, count=False)
                work.wait()
                whole = {i: torch.empty(opt.params[i].shape, dtype=dtype, device=flat.device) for i in layout.members}
                copy_back_(flat, *opt._placed(layout, whole.get, range(opt.dp_size)))
                out.update((opt.shards[i].name, t) for i, t in whole.items())
        return out

    def reset_peak(self) -> None:
        self.peak_gathered = self.num_gathered
