"""A hybrid parameter server for the input embedding (parallel.ps_servers, parallel.ps_sync).

MindSpore's parameter-server mode keeps big tables on server processes: workers pull the rows they need
and push gradients, the servers run the optimizer, and everything else trains with all-reduce. Here the
table is the untied input embedding (V x d): its gradient touches only the rows of the batch's tokens.

    world = dp x tp x pp workers (the mesh, ranks 0..W-1) + S servers (ranks W..W+S-1)

Servers. Server i holds rows [i * ceil(V/S), ...) of the table in host memory: the fp32 weight, its
AdamW moments, and a gradient buffer, and applies the update. It runs no model compute.

Workers. Only the first pipeline stage talks to servers, and of it only tp rank 0 of each dp rank (the
"pushers", dims.ps_pushers). Per step, not per microbatch (one round trip, and the microbatches of a
step share most of their tokens): the pusher sends the sorted unique token ids of its step batch to
each server that owns some of them and receives those rows, a compact (U, d) table; its tp peers get the
rows by a broadcast over tp (they hold the same batch, so they compute the same ids). The forward gathers
from the compact table (PSEmbedding); the backward leaves one summed gradient row per unique id in
its .grad (summed over tp first under sequence parallelism, where each tp rank embeds a slice of the
sequence), which the pusher sends back. No worker holds the table.

Transport: torch.distributed point-to-point on a gloo group of pushers and servers (dims.ps_group),
also on GPU machines. A message is a fixed header [op, step, n, aux] then its payload; a server
receives headers from any source and serves them in arrival order, answering each worker's pulls in
the order it asked them.

Consistency (parallel.ps_sync):
- bsp: the server sums every pusher's rows for step t into a dense gradient of its shard, sends each
  pusher the shard's squared norm (the global gradient norm, hence clipping, includes the table), then
  waits for rank 0's APPLY with the clip factor and learning rate and runs one dense AdamW step: rows
  no batch touched still get moment decay (and weight decay, were embeddings decayed). The result is
  the all-reduce run's update, to summation-order round-off. A pull for step t waits for version t - 1.
- ssp: the same one-update-per-step aggregation, but a pull for step t is answered once the server's
  version (steps applied) is at least t - 1 - parallel.staleness, so workers run up to s steps ahead.
  The table's gradient is not clipped (the norm would need every worker's push: a barrier); the dense
  parameters clip on their own norm. With s = 0 and train.grad_clip 0 this is bsp exactly.
- async: each push is applied when it arrives, as its own AdamW step (the worker's rows times P, the
  mean over its batch, at lr / P for P pushers); pulls are never held back. The staleness of each push
  (updates applied between its pull and its apply) is recorded.
Each server logs every pull (worker, step, version served) and every apply to
run.output_dir/ps-server-<i>.jsonl: the staleness bounds are checked from these logs. A resumed run
cuts the log back to the checkpoint's step, as it does metrics.jsonl.

Prefetch: under bsp, as soon as a step's APPLY is sent the pusher asks for the next step's rows
(Loader.peek_inputs) and receives them while the dense optimizer step, logging and the next batch's
preparation run. Under ssp and async it asks for them right after the step's own rows arrived, so the
pull overlaps the whole step: those rows cannot hold this step's update, hence a staleness of at least
one from the second step on (ssp needs staleness >= 1 for this reason). The dense parameters stay
bulk-synchronous, so workers never drift more than a step apart here: the bound s limits how far the
table may lag behind the servers' slowest aggregation, not the workers' clocks.

Checkpoints: every pusher sends each server a SAVE marker behind its pushes of the save's step; once it
has every pusher's marker, the server has applied every push up to that step, and it joins the same
sharded checkpoint with its rows of model/embed.weight and of its optimizer state under the same names
a run without servers writes, so a checkpoint moves between runs with and without servers (the table is
just a tensor there). Its version and the rows it served ahead of the save go in too (ps/state.py).
"""
from __future__ import annotations

import json
import math
import os
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipetrain.faults import Faults
from pipetrain.parallel.mesh.comm import all_reduce_, broadcast_, group_size, irecv, isend, recv_, recv_any_, send_
from pipetrain.parallel.ps.state import ServedPulls, read_server_state, server_log, state_items

OP_PULL, OP_PUSH, OP_APPLY, OP_SAVE, OP_STOP = 1, 2, 3, 4, 5
TAG_ROWS, TAG_NORM = 11, 12  # server -> worker replies
HEADER = 4  # int64: op, step, n, aux
PS_DEVICE = torch.device("cpu")  # the servers' group is gloo on every machine (ParallelDims): CPU tensors


def row_range(vocab: int, servers: int, index: int) -> tuple[int, int]:
    """Rows [lo, hi) of server index: ceil(V / S) rows each, the last one fewer."""
    per = math.ceil(vocab / servers)
    return min(vocab, index * per), min(vocab, (index + 1) * per)


def pull_bytes(unique: int, d: int, servers_asked: int) -> int:
    """Bytes of one pull: the ids (int64) and headers out, the rows (fp32) and versions back."""
    return unique * 8 + unique * d * 4 + servers_asked * (HEADER * 8 + 8)


def push_bytes(unique: int, d: int, servers_asked: int) -> int:
    """Bytes of one push: headers, ids (int64) and one fp32 gradient row per unique id."""
    return servers_asked * HEADER * 8 + unique * 8 + unique * d * 4


def required_version(mode: str, staleness: int, step: int) -> int:
    """The oldest server version a pull for `step` (1-based) may see: every update before it (bsp),
    all but the newest `staleness` (ssp), anything (async)."""
    if mode == "bsp":
        return step - 1
    if mode == "ssp":
        return max(0, step - 1 - staleness)
    return 0


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


def _header(op: int, step: int = 0, n: int = 0, aux: int = 0) -> torch.Tensor:
    return torch.tensor([op, step, n, aux], dtype=torch.int64, device=PS_DEVICE)


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
            head = _header(OP_PULL, step, sub.numel(), required)
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
            self._send(_header(OP_PUSH, step, n, self.version), server)
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
            self._send(_header(OP_APPLY, step), server)
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
            send_(_header(op, step), server, self.group)

    def announce_save(self, step: int) -> None:
        """Every pusher, before a checkpoint: the servers join this save once each pusher's is announced."""
        self._control(OP_SAVE, step)

    def stop(self, step: int) -> None:
        """At the end of the run: every worker's sends complete (no transfer outlives the process group), then
        rank 0 tells the servers to finish their writes and return."""
        self._finish_sends()
        self._prefetched = None
        self._control(OP_STOP, step)


# -- the server ----------------------------------------------------------------------------------
class Server:
    """One server rank: its rows of the table, their AdamW state, the protocol loop and its log."""

    def __init__(self, recipe, dims, lr_at: Callable[[int], float]):
        from pipetrain.models.init import init_tensor
        from pipetrain.optim.adamw import decays
        from pipetrain.optim.torch_opt import build_torch_opt
        p, m = recipe.parallel, recipe.model
        self.recipe, self.dims, self.lr_at = recipe, dims, lr_at
        self.index = dims.rank - dims.world_size
        self.lo, self.hi = row_range(m.vocab_size, p.ps_servers, self.index)
        self.mode, self.staleness = p.ps_sync, p.staleness
        self.pushers = dims.ps_pushers
        self.group = dims.ps_group
        self.vocab, self.d = m.vocab_size, m.d_model
        full = init_tensor(m, "embed.weight", (m.vocab_size, m.d_model), recipe.train.seed)
        self.weight = nn.Parameter(full[self.lo:self.hi].clone())  # (rows, d) fp32, host memory
        del full
        wd = recipe.train.weight_decay if decays("embed.weight", self.weight) else 0.0
        self.torch_opt = build_torch_opt([{"params": [self.weight], "weight_decay": wd}], recipe.train)
        self.version = 0           # steps (bsp, ssp) or pushes (async) applied
        self.step = 0              # the trainer step of the last save / apply: checkpoints
        self.steps_taken = 0
        self._pending: dict[int, dict[int, tuple]] = {}  # step -> {pusher: (ids, rows, pulled version)}
        self._pulls: dict[int, list] = {w: [] for w in self.pushers}  # each worker's unanswered pulls, in order
        self._sends: list = []
        self._saves: dict[int, set[int]] = {}  # step -> pushers whose SAVE marker arrived
        self._served = ServedPulls()            # ssp / async: rows answered ahead of their push (checkpoints)
        self._resumed: dict = {}                # (worker, step) -> the rows the original run served it
        self.checkpointer = None
        self.faults = Faults(recipe.faults, dims.rank)  # faults.kill_rank may name a server: killed at its push
        os.makedirs(recipe.run.output_dir, exist_ok=True)
        self._log = None
        self.open_log()

    def open_log(self) -> None:
        """(Re)open this server's log for appending; after a resume cuts the log back (a rewrite, so a new
        file) the server must write to the new one."""
        if self._log is not None:
            self._log.close()
        self._log = open(server_log(self.recipe.run.output_dir, self.index), "a")

    # -- state for checkpoints (pipetrain.checkpoint.save.Saveable) ---------------------------------
    def _entries(self):
        return [("embed.weight", self.weight, (self.vocab, self.d), (self.lo, 0))]

    def checkpoint_state(self, trainable_only: bool) -> tuple[int, list, dict]:
        """(step, items, {}): this server's rows, their optimizer state and ps/state.py's; a server is never
        rank 0, so it writes no run state into the manifest. trainable_only is False: LoRA refuses servers."""
        from pipetrain.optim.torch_opt import torch_opt_state_items
        items = [("model/embed.weight", self.weight.detach(), (self.vocab, self.d), [self.lo, 0])]
        for name, tensor, shape, offsets in torch_opt_state_items(self.torch_opt, self._entries(), self.steps_taken):
            if name != "step":  # the workers write the optimizer's step
                items.append((f"optim/{name}", tensor.detach(), tuple(shape), list(offsets)))
        stale = self._served.stale(self.step, self.version)
        items += state_items(self.index, len(self.dims.server_ranks), self.version, stale, self.d)
        return self.step, items, {}

    def load(self, read: Callable, manifest: dict) -> None:
        """Rows and moments of a checkpoint (written with or without servers), its version and the rows
        served ahead of it (ps/state.py); read(name, offsets, shape) returns that box of a saved tensor."""
        from pipetrain.optim.torch_opt import load_torch_opt_state
        self.step = manifest["step"]
        self.version, self._resumed = read_server_state(manifest, read, self.index, self.mode, self.dims)
        with torch.no_grad():
            self.weight.copy_(read("model/embed.weight", [self.lo, 0], tuple(self.weight.shape)).float())

        def read_optim(name, global_shape, offsets, shape):  # AdamW's step count is the version (async: pushes)
            return torch.tensor(self.version, device=PS_DEVICE) if name == "step" else read(f"optim/{name}", offsets, shape).float()
        self.steps_taken = load_torch_opt_state(self.torch_opt, self._entries(), read_optim, False)
        self._served.last_push = {w: self.step for w in self.pushers}

    # -- the loop --------------------------------------------------------------------------------
    def serve(self) -> None:
        """Answer workers until rank 0 says stop."""
        header = torch.zeros(HEADER, dtype=torch.int64, device=PS_DEVICE)
        try:
            while True:
                src = recv_any_(header, self.group)
                op, step, n, aux = (int(x) for x in header)
                if op == OP_PULL:
                    ids = torch.empty(n, dtype=torch.int64, device=PS_DEVICE)
                    recv_(ids, src, self.group)
                    self._pulls[src].append((step, aux, ids))
                    self._answer_pulls()
                elif op == OP_PUSH:
                    ids = torch.empty(n, dtype=torch.int64, device=PS_DEVICE)
                    rows = torch.empty(n, self.d, dtype=torch.float32, device=PS_DEVICE)
                    if n:
                        recv_(ids, src, self.group)
                        recv_(rows, src, self.group)
                    self._on_push(src, step, ids, rows, aux)
                elif op == OP_APPLY:
                    payload = torch.zeros(2, dtype=torch.float64, device=PS_DEVICE)
                    recv_(payload, src, self.group)
                    coef = float(payload[0])
                    self._apply_step(step, None if coef < 0 else coef, float(payload[1]))
                elif op == OP_SAVE:
                    self._on_save(src, step)
                elif op == OP_STOP:
                    break
        finally:
            for w, _ in self._sends:
                w.wait()
            self._sends = []
            if self.checkpointer is not None:
                self.checkpointer.wait()
            self._log.close()

    def _write(self, record: dict) -> None:
        self._log.write(json.dumps(record) + "\n")
        self._log.flush()

    def _answer_pulls(self) -> None:
        """Answer each worker's pulls in the order asked, as far as the version allows."""
        for worker, queue in self._pulls.items():
            while queue and self.version >= queue[0][1]:
                step, required, ids = queue.pop(0)
                rows = self.weight.detach()[ids - self.lo].contiguous()
                version = torch.tensor([self.version], dtype=torch.int64, device=PS_DEVICE)
                saved = self._resumed.pop((worker, step), None)
                if saved is not None and torch.equal(saved[1], ids):  # what the original run served this pull
                    version[0], rows = saved[0], saved[2].contiguous()
                served = int(version[0])
                if self.mode != "bsp":
                    self._served.answered(worker, step, served, ids, rows)
                for t in (version, rows):
                    self._sends.append((isend(t, worker, self.group, TAG_ROWS), t))
                self._write({"event": "pull", "worker": worker, "step": step, "version": served,
                             "required": required, "rows": int(ids.numel())})
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]

    def _dense_grad(self, pushes: dict) -> torch.Tensor:
        grad = torch.zeros_like(self.weight)
        for worker in sorted(pushes):  # a fixed order: the sum is deterministic
            ids, rows, _ = pushes[worker]
            if ids.numel():
                grad.index_add_(0, ids - self.lo, rows)
        return grad

    def _on_push(self, worker: int, step: int, ids, rows, pulled_version: int) -> None:
        self.faults.maybe_kill(step)
        self._served.pushed(worker, step)
        if self.mode == "async":
            grad = self._dense_grad({worker: (ids, rows, pulled_version)}) * len(self.pushers)
            staleness = self.version - pulled_version
            self._adamw(grad, self.lr_at(step) / len(self.pushers))
            self._write({"event": "apply", "version": self.version, "step": step, "worker": worker,
                         "staleness": staleness})
            self._answer_pulls()
            return
        self._pending.setdefault(step, {})[worker] = (ids, rows, pulled_version)
        if self.mode == "bsp":
            pushes = self._pending[step]
            if len(pushes) == len(self.pushers):
                self._grad = self._dense_grad(pushes)
                sq = torch.tensor([float(self._grad.double().square().sum())], dtype=torch.float64, device=PS_DEVICE)
                for w in sorted(pushes):
                    self._sends.append((isend(sq, w, self.group, TAG_NORM), sq))
            return
        while len(self._pending.get(self.version + 1, {})) == len(self.pushers):  # ssp: in step order
            step = self.version + 1
            self._adamw(self._dense_grad(self._pending.pop(step)), self.lr_at(step))
            self._write({"event": "apply", "version": self.version, "step": step})
        self._answer_pulls()

    def _on_save(self, worker: int, step: int) -> None:
        """A pusher's SAVE marker for `step`. It follows that pusher's pushes, so with every pusher's marker
        in, every push up to `step` has arrived and is applied (bsp: rank 0's APPLY came before its marker):
        the snapshot pairs the table with the workers' weights of the same step."""
        waiting = self._saves.setdefault(step, set())
        waiting.add(worker)
        if len(waiting) < len(self.pushers):
            return
        del self._saves[step]
        assert self.mode == "async" or self.version == step, \
            f"server {self.index}: saving step {step} at version {self.version}"
        self.step = step
        self.checkpointer.save(self)

    def _apply_step(self, step: int, coef: float | None, lr: float) -> None:
        """bsp: apply step `step`'s summed gradient with the workers' clip factor and learning rate."""
        assert step == self.version + 1 and len(self._pending.get(step, {})) == len(self.pushers), \
            f"server {self.index}: APPLY for step {step} at version {self.version}"
        grad = self._grad
        if coef is not None:
            grad.mul_(coef)
        self._pending.pop(step)
        self._adamw(grad, lr)
        self._grad = None
        self._write({"event": "apply", "version": self.version, "step": step})
        self._answer_pulls()

    def _adamw(self, grad: torch.Tensor, lr: float) -> None:
        from pipetrain.optim.adamw import set_lr
        self.weight.grad = grad
        set_lr(self.torch_opt, lr)
        self.torch_opt.step()
        self.weight.grad = None
        self.version += 1
        self.steps_taken += 1
