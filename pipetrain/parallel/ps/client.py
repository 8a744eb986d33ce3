"""The workers' side of the parameter server: PSClient (pull, push, prefetch) and PSEmbedding.

Only the first pipeline stage talks to servers, and of it only tp rank 0 of each dp rank (the "pushers",
dims.ps_pushers). Per step, not per microbatch (one round trip, and the microbatches of a step share most
of their tokens): the pusher sends the sorted unique token ids of its step batch to each server that owns
some of them and receives those rows, a compact (U, d) table; its tp peers get the rows by a broadcast over
tp (they hold the same batch, so they compute the same ids). The forward gathers from the compact table
(PSEmbedding); the backward leaves one summed gradient row per unique id in its .grad (summed over tp first
under sequence parallelism, where each tp rank embeds a slice of the sequence), which the pusher sends
back. No worker holds the table.

bsp: each pusher's push is answered with its server shard's squared gradient norm (the global gradient
norm, hence clipping, includes the table); rank 0 then sends every server APPLY with the clip factor and
learning rate. ssp and async: pushes are not answered; the table's gradient is not clipped.

Prefetch: under bsp, as soon as a step's APPLY is sent the pusher asks for the next step's rows
(Loader.peek_inputs) and receives them while the dense optimizer step, logging and the next batch's
preparation run. Under ssp and async it asks for them right after the step's own rows arrived, so the
pull overlaps the whole step: those rows cannot hold this step's update, hence a staleness of at least
one from the second step on (ssp needs staleness >= 1 for this reason). The dense parameters stay
bulk-synchronous, so workers never drift more than a step apart here: the bound s limits how far the
table may lag behind the servers' slowest aggregation, not the workers' clocks.

Checkpoints: every pusher sends each server a SAVE marker behind its pushes of the save's step
(announce_save); the servers join the workers' checkpoint (ps/server.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipetrain.parallel.mesh.comm import all_reduce_, broadcast_, group_size, irecv, isend, recv_, send_
from pipetrain.parallel.ps.protocol import (OP_APPLY, OP_PULL, OP_PUSH, OP_SAVE, OP_STOP, PS_DEVICE, TAG_NORM,
                                            TAG_ROWS, header, pull_bytes, push_bytes, required_version, row_range)


class PSEmbedding(nn.Module):
    """The first stage's input embedding under a parameter server: no weight, only this step's compact
    table of the rows its batch uses. ids (B, T) -> (B, T, D), or (B, T/tp, D) under sequence parallelism."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group=None, tp_rank: int = 0,
                 sequence_parallel: bool = False):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_group, self.tp_rank = tp_group, tp_rank
        self.sequence_parallel = sequence_parallel and group_size(tp_group) > 1
        self.ids: torch.Tensor | None = None    # (U,) sorted unique token ids
        self.table: torch.Tensor | None = None  # (U, D) leaf; its .grad is the step's summed row gradient

    def set_table(self, ids: torch.Tensor, table: torch.Tensor) -> None:
        self.ids, self.table = ids, table

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.table is not None, "PSEmbedding: no rows were pulled for this batch"
        local = torch.searchsorted(self.ids, x)  # position of each token in the compact table
        h = F.embedding(local, self.table)
        if self.sequence_parallel:
            return h.chunk(group_size(self.tp_group), dim=1)[self.tp_rank].contiguous()
        return h

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim}, rows from parameter servers"




class _Pull:
    """A pull in flight: per server asked, (receive works, version box, rows box); its bytes."""

    def __init__(self, step: int, ids: torch.Tensor, parts: list, sends: list, nbytes: int):
        self.step, self.ids, self.parts, self.sends, self.bytes = step, ids, parts, sends, nbytes

    def wait(self) -> tuple[torch.Tensor, int]:
        """(rows (U, D) in ids order, the oldest version any server served)."""
        for w, _ in self.sends:
            w.wait()
        rows, version = [], None
        for works, ver, box in self.parts:
            for w in works:
                w.wait()
            rows.append(box)
            version = int(ver[0]) if version is None else min(version, int(ver[0]))
        table = torch.cat(rows) if rows else torch.zeros(0, 0, device=PS_DEVICE)
        return table, (version if version is not None else -1)


class PSClient:
    """A worker's side: pull before a step's forward, push after its backward, prefetch the next step.
    Every rank of the mesh has one (most only join the tp broadcast or nothing)."""

    def __init__(self, recipe, dims, embed: PSEmbedding | None):
        p = recipe.parallel
        self.recipe, self.dims, self.embed = recipe, dims, embed
        self.mode, self.staleness = p.ps_sync, p.staleness
        self.early = self.mode != "bsp"  # prefetch the next step's rows before this step's push
        self.vocab, self.d = recipe.model.vocab_size, recipe.model.d_model
        self.pusher = dims.rank in dims.ps_pushers
        self.servers = dims.server_ranks
        self.ranges = [row_range(self.vocab, len(self.servers), i) for i in range(len(self.servers))]
        self.group = dims.ps_group
        self._prefetched: _Pull | None = None
        self._sends: list = []   # (work, tensors kept alive until it completes)
        self.version = -1        # the oldest version this step's rows came from
        self.bytes_pulled = 0    # this step, this rank (pull_bytes / push_bytes)
        self.bytes_pushed = 0

    # -- pulls -----------------------------------------------------------------------------------
    def _request(self, step: int, inputs: torch.Tensor, required: int) -> _Pull:
        ids = torch.unique(inputs.reshape(-1).cpu())  # sorted
        parts, sends, nbytes = [], [], 0
        for server, (lo, hi) in zip(self.servers, self.ranges):
            sub = ids[(ids >= lo) & (ids < hi)].contiguous()
            if sub.numel() == 0:
                continue
            head = header(OP_PULL, step, sub.numel(), required)
            sends += [(isend(head, server, self.group), head), (isend(sub, server, self.group), sub)]
            version = torch.zeros(1, dtype=torch.int64, device=PS_DEVICE)
            rows = torch.empty(sub.numel(), self.d, dtype=torch.float32, device=PS_DEVICE)
            works = [irecv(version, server, self.group, TAG_ROWS),
                     irecv(rows, server, self.group, TAG_ROWS)]
            parts.append((works, version, rows))
            nbytes += pull_bytes(sub.numel(), self.d, 1)
        return _Pull(step, ids, parts, sends, nbytes)

    def _install(self, pull: _Pull | None, inputs: torch.Tensor, train: bool) -> None:
        """Wait for this rank's pusher's rows, share them over tp, make them the compact table."""
        dims = self.dims
        if pull is not None:
            rows, self.version = pull.wait()
            ids = pull.ids
            self.bytes_pulled = pull.bytes
        else:  # a tp peer of the pusher: same batch, same ids; the rows come by broadcast
            ids = torch.unique(inputs.reshape(-1).cpu())
            rows = torch.empty(ids.numel(), self.d, dtype=torch.float32, device=PS_DEVICE)
        if dims.tp > 1:
            rows = rows.to(dims.device)
            broadcast_(rows, dims.global_rank(dims.dp_rank, 0, 0), dims.tp_group)
        table = rows.to(dims.device)  # fp32, like the weights (bf16 runs autocast the matmuls)
        self.embed.set_table(ids.to(dims.device), table.requires_grad_(train))

    def begin_step(self, step: int, inputs: torch.Tensor) -> None:
        """Before step `step`'s forward: this step's rows in the embedding (prefetched, or pulled now)."""
        if self.embed is None:
            return
        self.bytes_pulled = self.bytes_pushed = 0
        pull = None
        if self.pusher:
            pull = self._prefetched
            if pull is None or pull.step != step:
                pull = self._request(step, inputs, required_version(self.mode, self.staleness, step))
            elif not torch.equal(pull.ids, torch.unique(inputs.reshape(-1).cpu())):
                # the loader's peek disagreed with the batch it served: the rows would be another batch's
                raise RuntimeError(f"{self.dims.coords} PSClient: the rows prefetched for step {step} are not "
                                   "this batch's token ids; the loader's peek_inputs and next() disagree")
            self._prefetched = None
        self._install(pull, inputs, train=True)

    def begin_eval(self, step: int, inputs: torch.Tensor) -> None:
        """Rows for an evaluation batch after step `step` (no gradient)."""
        if self.embed is None:
            return
        pull = self._request(step, inputs, required_version(self.mode, self.staleness, step + 1)) \
            if self.pusher else None
        self._install(pull, inputs, train=False)

    def prefetch(self, step: int, inputs: torch.Tensor) -> None:
        """Ask now for the rows of step `step` (the next one); begin_step(step) collects them."""
        if self.embed is not None and self.pusher:
            self._prefetched = self._request(step, inputs, required_version(self.mode, self.staleness, step))

    # -- pushes ----------------------------------------------------------------------------------
    def push(self, step: int) -> float:
        """After step `step`'s backward: send the summed row gradients; returns the table gradient's
        squared norm under bsp (on pushers; 0 elsewhere and in the relaxed modes)."""
        self._finish_sends()
        if self.embed is None:
            return 0.0
        table = self.embed.table
        grad = table.grad if table.grad is not None else torch.zeros_like(table)
        if self.embed.sequence_parallel:  # each tp rank embedded a slice of the sequence
            all_reduce_(grad, self.dims.tp_group)
        if not self.pusher:
            return 0.0
        grad = grad.detach().float().cpu()
        ids = self.embed.ids.cpu()
        asked = []
        for server, (lo, hi) in zip(self.servers, self.ranges):
            keep = (ids >= lo) & (ids < hi)
            n = int(keep.sum())
            if n == 0 and self.mode == "async":
                continue  # bsp and ssp count a push from every pusher per step, even an empty one
            sub_ids, sub_rows = ids[keep].contiguous(), grad[keep].contiguous()
            self._send(header(OP_PUSH, step, n, self.version), server)
            if n:
                self._send(sub_ids, server)
                self._send(sub_rows, server)
            self.bytes_pushed += push_bytes(n, self.d, 1)
            asked.append(server)
        if self.mode != "bsp":
            return 0.0
        total = 0.0
        for server in asked:
            box = torch.zeros(1, dtype=torch.float64, device=PS_DEVICE)
            recv_(box, server, self.group, TAG_NORM)
            total += float(box[0])
        return total

    def apply(self, step: int, coef: float | None, lr: float) -> None:
        """bsp: rank 0 tells every server to apply step `step` with the clip factor and learning rate
        every worker computed."""
        if self.mode != "bsp" or self.dims.rank != 0:
            return
        payload = torch.tensor([-1.0 if coef is None else coef, lr], dtype=torch.float64, device=PS_DEVICE)
        for server in self.servers:
            self._send(header(OP_APPLY, step), server)
            self._send(payload, server)

    def _send(self, tensor: torch.Tensor, server: int) -> None:
        self._sends.append((isend(tensor, server, self.group), tensor))

    def _finish_sends(self) -> None:
        for w, _ in self._sends:
            w.wait()
        self._sends = []

    def _control(self, op: int, step: int) -> None:
        # SAVE is a marker in every pusher's stream behind its pushes (a server saves once it has all of
        # them: every push up to the save is in); STOP comes from rank 0 alone
        if not (self.pusher if op == OP_SAVE else self.dims.rank == 0):
            return
        self._finish_sends()
        for server in self.servers:
            send_(header(op, step), server, self.group)

    def announce_save(self, step: int) -> None:
        """Every pusher, before a checkpoint: the servers join this save once each pusher's is announced."""
        self._control(OP_SAVE, step)

    def stop(self, step: int) -> None:
        """At the end of the run: every worker's sends complete (no transfer outlives the process group), then
        rank 0 tells the servers to finish their writes and return."""
        self._finish_sends()
        self._prefetched = None
        self._control(OP_STOP, step)
