"""run_schedule: execute one rank's pipeline action list (pipetrain.parallel.pipeline.schedules).

The executor knows nothing of any particular schedule: it walks the list, runs F, B and W on the
chunk modules, and posts point-to-point transfers (pipetrain.parallel.mesh.comm.post_p2p). Each maximal
run of consecutive communication actions is posted together: with one batch_isend_irecv (batch_p2p=True,
the default except on gloo; the "rendezvous" semantics the schedules are proven deadlock-free under),
or one by one (batch_p2p=False, the default on gloo, where a send only completes once the peer posts
its receive). Each receive is waited for right before the compute that consumes it (so it
can arrive while this rank computes, and a W placed before that compute fills the wait) and sends
only at the end of the step. Waiting later than the schedule's receive point never adds a wait-for
edge, so the schedules' deadlock-freedom carries over (docs/pipeline.md measures the difference).

Split backward: the F and B of a (microbatch, chunk) that has a W action in the list run inside
deferring (pipetrain.parallel.pipeline.weight_grads), so B computes the input gradient the previous stage
waits for and the chunk's WeightGradModules record their weight-gradient work; the W action does that
work. Linears that apply_grad_accumulation_fusion did not make WeightGradModules do their whole
backward in B.

Stages on the same rank (the V placement of zbv and dualpipev: rank p-1 holds stages p-1 and p) hand
their tensors over locally: the schedule has no SEND/RECV for that edge, the next chunk's F takes the
previous chunk's output (detached, as a received tensor would be) and the previous chunk's B takes the
input gradient the next chunk's B left. The executor sees this from the chunk specs' stage numbers.

Every transferred tensor has the shape and dtype agreed up front from the recipe
(microbatch, T or T/tp under sequence parallelism, D); a tensor that does not match raises before
anything is sent, instead of hanging the peer.

Loss scaling: the last stage's F computes sum(CE) over the microbatch's targets divided by the
target tokens of the whole global batch, so accumulated gradients equal the single-process
gradient of the global mean loss.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
import torch.nn as nn

from pipetrain.parallel.mesh.comm import batches_p2p_by_default, post_p2p
from pipetrain.parallel.pipeline.schedules import (B, F, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, W, Action)
from pipetrain.parallel.pipeline.weight_grads import (apply_weight_grads, assign_work_keys, deferring,
                                                      weight_grad_modules)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t (a CPU batch tensor) on device, without the host waiting for the device: to a GPU it is copied from
    pinned memory with non_blocking (a plain .to() from pageable memory synchronises with the stream, so the
    GPU would drain before every microbatch's forward while the host launches it); elsewhere t.to(device)."""
    if device.type != "cuda" or not t.is_cpu:  # not t.device == device: "cuda" is not "cuda:0"
        return t.to(device)
    return t.contiguous().pin_memory().to(device, non_blocking=True)  # a strided source would be staged pageable


class Executor:
    """Runs schedules for one rank's chunks; holds no state between steps."""

    def __init__(self, chunks: Sequence[nn.Module], specs, dims, act_shape: tuple[int, ...], act_dtype: torch.dtype,
                 loss_fn: Callable, autocast=contextlib.nullcontext, batch_p2p: bool | None = None):
        """batch_p2p: post each run of sends and receives as one batch_isend_irecv (True) or one by one
        (False); None picks by backend (comm.batches_p2p_by_default: one by one on gloo)."""
        self.chunks, self.specs, self.dims = list(chunks), list(specs), dims
        self.act_shape, self.act_dtype = tuple(act_shape), act_dtype
        self.loss_fn, self.autocast = loss_fn, autocast
        self.batch_p2p = batches_p2p_by_default() if batch_p2p is None else batch_p2p
        # Local hand-offs: this rank's chunk holding the previous / next stage of each chunk, else None.
        chunk_of_stage = {spec.stage: c for c, spec in enumerate(self.specs)}
        self.prev_local = [chunk_of_stage.get(spec.stage - 1) for spec in self.specs]
        self.next_local = [chunk_of_stage.get(spec.stage + 1) for spec in self.specs]
        # Whether run() returns a loss: the rank holding the last stage (pp-1, or 0 in the V placement).
        self.holds_last_stage = any(spec.is_last for spec in self.specs)
        # A context around each run: the fp8 weights quantised once per run (fp8.Fp8WeightCache.run)
        self.around_run: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def _peer(self, pp_rank: int) -> int:
        d = self.dims
        return d.global_rank(d.dp_rank, pp_rank, d.tp_rank, d.cp_rank)

    def _check(self, t: torch.Tensor, what: str) -> torch.Tensor:
        if tuple(t.shape) != self.act_shape or t.dtype != self.act_dtype:
            raise RuntimeError(f"{self.dims.coords} pipeline {what}: tensor {tuple(t.shape)} {t.dtype} does not match "
                               f"the agreed {self.act_shape} {self.act_dtype}; stages disagree on the layout")
        return t.contiguous()

    def run(self, actions: Sequence[Action], microbatches, num_targets: int, forward_only: bool = False):
        """Execute actions; returns this rank's summed loss (0 unless it holds the last stage)."""
        with self.around_run():
            return self._run(actions, microbatches, num_targets, forward_only)

    def _run(self, actions: Sequence[Action], microbatches, num_targets: int, forward_only: bool):
        device = self.dims.device
        inputs, outputs, losses, grads_in, grads_out, weight_work = {}, {}, {}, {}, {}, {}
        split = {(a.microbatch, a.chunk) for a in actions if a.kind == W}
        total = torch.zeros((), device=device)
        posted, pending_recvs = [], {}  # every Work of the step, kept alive to its end so ids stay unique

        # keyed: a compiled block's linears can then defer too (weight_grads.assign_work_keys; once per module)
        deferrable = [assign_work_keys(weight_grad_modules(chunk)) for chunk in self.chunks] if split else None

        def deferral(key):  # F and B of a split (microbatch, chunk): linears record their weight work
            if key not in split:
                return contextlib.nullcontext()
            return deferring(deferrable[key[1]], weight_work.setdefault(key, []))

        waited: set[int] = set()

        def wait(work) -> None:  # exactly once: a gloo p2p Work's wait() blocks for the next transfer
            if id(work) not in waited:
                waited.add(id(work))
                work.wait()

        def arrived(kind: str, key) -> None:
            for work in pending_recvs.pop((kind, *key), ()):
                wait(work)
        comm_batch: list[Action] = []

        def flush():
            if not comm_batch:
                return
            ops, recvs = [], []
            for a in comm_batch:
                key, peer = (a.microbatch, a.chunk), self._peer(a.peer)
                if a.kind == SEND_ACT:
                    out = outputs.pop(key) if forward_only else outputs[key]  # training keeps it for B
                    ops.append((True, self._check(out.detach(), "send activation"), peer))
                elif a.kind == SEND_GRAD:
                    ops.append((True, self._check(grads_in.pop(key), "send gradient"), peer))
                else:
                    buf = torch.empty(self.act_shape, dtype=self.act_dtype, device=device)
                    recvs.append((a, buf, len(ops)))
                    ops.append((False, buf, peer))
            # Batched, a receive waits for the whole batch (NCCL may coalesce it into one Work); one by
            # one, for its own Work. Either way right before the compute that consumes it.
            op_works = post_p2p(ops, self.batch_p2p)
            for works in op_works:
                posted.extend(works)  # a batch's Works repeat per op: wait() takes each once
            for a, buf, index in recvs:
                key = (a.microbatch, a.chunk)
                pending_recvs[(a.kind, *key)] = op_works[index]
                if a.kind == RECV_ACT:
                    inputs[key] = buf.requires_grad_(not forward_only)
                else:
                    grads_out[key] = buf
            comm_batch.clear()

        for a in actions:
            if a.kind in (B, W, SEND_GRAD, RECV_GRAD) and forward_only:
                continue
            if a.is_comm:
                comm_batch.append(a)
                continue
            flush()
            key = (a.microbatch, a.chunk)
            spec, chunk = self.specs[a.chunk], self.chunks[a.chunk]
            mb = microbatches[a.microbatch]
            prev, nxt = self.prev_local[a.chunk], self.next_local[a.chunk]
            if a.kind == F:
                if prev is not None:  # the previous stage is on this rank: its output, detached like a receive
                    out_prev = outputs.pop((a.microbatch, prev)) if forward_only else outputs[(a.microbatch, prev)]
                    inputs[key] = out_prev.detach().requires_grad_(not forward_only)
                elif not spec.is_first:
                    arrived(RECV_ACT, key)
                x = to_device(mb.inputs, device) if spec.is_first else inputs[key]
                with self.autocast(), deferral(key) if not forward_only else contextlib.nullcontext():
                    positions = getattr(mb, "positions", None)  # document masking: (B, T) for every stage
                    if positions is not None:  # to the device once, not by each layer's .to(): a host sync apiece
                        positions = to_device(positions, device)
                    out = chunk(x) if positions is None else chunk(x, positions)
                if spec.is_last:
                    loss = self.loss_fn(out, mb.targets)  # targets stay on the CPU (see loss_sum)
                    total += loss.detach().float()
                    if not forward_only:
                        losses[key] = loss / num_targets
                else:
                    outputs[key] = out
                if forward_only:
                    inputs.pop(key, None)
            elif a.kind == B:
                if not spec.is_last and nxt is None:
                    arrived(RECV_GRAD, key)
                with deferral(key):  # recomputed forwards must take the deferred path too
                    if spec.is_last:
                        losses.pop(key).backward()
                    else:
                        torch.autograd.backward(outputs.pop(key), grads_out.pop(key))
                if prev is not None:  # the previous stage's B, on this rank, takes it directly
                    grads_out[(a.microbatch, prev)] = inputs.pop(key).grad
                elif not spec.is_first:
                    grads_in[key] = inputs.pop(key).grad
            elif a.kind == W:
                apply_weight_grads(weight_work.pop(key))
        flush()
        for work in posted:  # the sends, and any receive a schedule never consumed (asserted below)
            wait(work)
        assert not pending_recvs, f"{self.dims.coords} receives never consumed: {list(pending_recvs)}"
        assert not losses and not grads_out and not grads_in and not weight_work, \
            f"{self.dims.coords} schedule left work undone: {list(losses)} {list(grads_out)} {list(grads_in)} " \
            f"{list(weight_work)}"
        return total
