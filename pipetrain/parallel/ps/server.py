"""A parameter-server rank: its rows of the table, their AdamW state, the protocol loop and its log.

Server i holds rows row_range(V, S, i) of the table in host memory: the fp32 weight, its AdamW moments,
and (while a step is aggregated) a dense gradient of those rows, and applies the update. It runs no model
compute and never allocates the whole table: the seeded initialisation is drawn in chunks of the full
tensor's random stream (models.init.init_rows), bitwise the rows a full-table draw would give.

Consistency (parallel.ps_sync):
- bsp: the server sums every pusher's rows for step t into a dense gradient of its shard, sends each
  pusher the shard's squared norm, then waits for rank 0's APPLY with the clip factor and learning rate
  and runs one dense AdamW step: rows no batch touched still get moment decay (and weight decay, were
  embeddings decayed). The result is the all-reduce run's update, to summation-order round-off. A pull
  for step t waits for version t - 1.
- ssp: the same one-update-per-step aggregation, but a pull for step t is answered once the server's
  version (steps applied) is at least t - 1 - parallel.staleness. The table's gradient is not clipped
  (the norm would need every worker's push: a barrier). With s = 0 and train.grad_clip 0 this is bsp.
- async: each push is applied when it arrives, as its own AdamW step (the worker's rows times P, the
  mean over its batch, at lr / P for P pushers); pulls are never held back. The staleness of each push
  (updates applied between its pull and its apply) is recorded.
Each server logs every pull (worker, step, version served) and every apply to
run.output_dir/ps-server-<i>.jsonl: the staleness bounds are checked from these logs. A resumed run
cuts the log back to the checkpoint's step, as it does metrics.jsonl.

Checkpoints: once a server has every pusher's SAVE marker for a step, it has applied every push up to
that step, and it joins the same sharded checkpoint with its rows of model/embed.weight and of its
optimizer state under the same names a run without servers writes, so a checkpoint moves between runs
with and without servers (the table is just a tensor there). Its version and the rows it served ahead of
the save go in too (ps/state.py).
"""
from __future__ import annotations

import json
import os
from typing import Callable

import torch
import torch.nn as nn

from pipetrain.faults import Faults
from pipetrain.models.init import init_rows
from pipetrain.optim.adamw import decays, set_lr, step_adamw
from pipetrain.optim.torch_opt import build_torch_opt, load_torch_opt_state, torch_opt_state_items
from pipetrain.parallel.mesh.comm import isend, recv_, recv_any_
from pipetrain.parallel.ps.protocol import (HEADER, OP_APPLY, OP_PULL, OP_PUSH, OP_SAVE, OP_STOP, PS_DEVICE,
                                            TAG_NORM, TAG_ROWS, row_range)
from pipetrain.parallel.ps.state import ServedPulls, read_server_state, server_log, state_items


class Server:
    """One server rank: its rows of the table, their AdamW state, the protocol loop and its log."""

    def __init__(self, recipe, dims, lr_at: Callable[[int], float]):
        p, m = recipe.parallel, recipe.model
        self.recipe, self.dims, self.lr_at = recipe, dims, lr_at
        self.index = dims.rank - dims.world_size
        self.lo, self.hi = row_range(m.vocab_size, p.ps_servers, self.index)
        self.mode, self.staleness = p.ps_sync, p.staleness
        self.pushers = dims.ps_pushers
        self.group = dims.ps_group
        self.vocab, self.d = m.vocab_size, m.d_model
        rows = init_rows(m, "embed.weight", (m.vocab_size, m.d_model), recipe.train.seed, self.lo, self.hi)
        self.weight = nn.Parameter(rows)  # (rows, d) fp32, host memory: never the whole table
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
        self.weight.grad = grad
        set_lr(self.torch_opt, lr)
        step_adamw(self.torch_opt)
        self.weight.grad = None
        self.version += 1
        self.steps_taken += 1
