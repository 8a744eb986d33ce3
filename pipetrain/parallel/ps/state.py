"""What a parameter server's checkpoint holds besides its rows of the table and their optimizer state.

Resuming continues the run, so a server saves the two things that tell where its run stood:

- `ps/version` (S,) int64: server i's version at the save. Under bsp and ssp it equals the step (a server
  snapshots only once every push up to the save's step is applied); under async it counts pushes, and a
  resumed run counts on from it (and so does the AdamW step count behind the bias correction).
- the training pulls it answered for steps after the save from an older version than the one it saves
  (ssp and async prefetch step t+1's rows during step t, before step t's update): per server i,
  `ps/in_flight/<i>/pulls` (K, 4) int64 rows (worker, step, version, number of ids), `.../ids` (N,) int64
  and `.../rows` (N, D) fp32. A resumed run's pull for the same worker, step and ids gets these rows and
  their version, so it trains on what the original run trained on.

These names only exist in checkpoints written with servers; a run without servers ignores them, and a
checkpoint without them resumes with the version at the step and nothing in flight.

May import: torch. Never: trainer, build, checkpoint.
"""
from __future__ import annotations

import os
from typing import Callable

import torch

VERSION = "ps/version"


def server_log(output_dir: str, index: int) -> str:
    """Server `index`'s log of pulls and applies (a resumed run cuts it back to its checkpoint's step)."""
    return os.path.join(output_dir, f"ps-server-{index}.jsonl")


def _in_flight(index: int) -> str:
    return f"ps/in_flight/{index}"


class ServedPulls:
    """A server's answered training pulls whose push has not arrived yet: (worker, step) -> (version,
    ids, rows). A pull for a step the worker already pushed (an evaluation's) is not one of them."""

    def __init__(self):
        self.rows: dict[tuple[int, int], tuple[int, torch.Tensor, torch.Tensor]] = {}
        self.last_push: dict[int, int] = {}

    def answered(self, worker: int, step: int, version: int, ids: torch.Tensor, rows: torch.Tensor) -> None:
        if step > self.last_push.get(worker, 0):
            self.rows[(worker, step)] = (version, ids, rows)

    def pushed(self, worker: int, step: int) -> None:
        self.last_push[worker] = max(step, self.last_push.get(worker, 0))
        self.rows.pop((worker, step), None)

    def stale(self, step: int, version: int) -> list[tuple[int, int, int, torch.Tensor, torch.Tensor]]:
        """(worker, step, version, ids, rows) of the pulls for steps after `step` answered from a version
        older than `version`, in (worker, step) order."""
        return [(w, s, v, ids, rows) for (w, s), (v, ids, rows) in sorted(self.rows.items())
                if s > step and v < version]


def state_items(index: int, servers: int, version: int, stale: list, d: int) -> list:
    """Checkpoint items (name, tensor, global shape, offsets) of server `index`'s version and stale pulls."""
    items = [(VERSION, torch.tensor([version], dtype=torch.int64, device="cpu"), (servers,), [index])]
    if stale:
        pulls = torch.tensor([[w, s, v, ids.numel()] for w, s, v, ids, _ in stale], dtype=torch.int64, device="cpu")
        ids = torch.cat([ids for *_, ids, _ in stale])
        rows = torch.cat([rows for *_, rows in stale])
        base = _in_flight(index)
        items += [(f"{base}/pulls", pulls, tuple(pulls.shape), [0, 0]),
                  (f"{base}/ids", ids, tuple(ids.shape), [0]),
                  (f"{base}/rows", rows, (ids.numel(), d), [0, 0])]
    return items


def read_version(manifest: dict, read: Callable, index: int, servers: int) -> int:
    """Server `index`'s saved version: its own with the same number of servers, else the newest any
    server saved (never one a run already used); the step when the checkpoint has none."""
    info = manifest["tensors"].get(VERSION)
    if info is None:
        return manifest["step"]
    saved = read(VERSION, [0], tuple(info["global_shape"])).long()
    return int(saved[index]) if saved.numel() == servers else int(saved.max())


def read_in_flight(manifest: dict, read: Callable, index: int) -> dict:
    """{(worker, step): (version, ids, rows)} of server `index`'s saved stale pulls ({} when none)."""
    base = _in_flight(index)
    info = manifest["tensors"].get(f"{base}/pulls")
    if info is None:
        return {}
    shape = tuple(info["global_shape"])
    pulls = read(f"{base}/pulls", [0, 0], shape).long()
    total = int(pulls[:, 3].sum())
    ids = read(f"{base}/ids", [0], (total,)).long()
    rows = read(f"{base}/rows", [0, 0], (total, manifest["tensors"][f"{base}/rows"]["global_shape"][1])).float()
    out, at = {}, 0
    for w, s, v, n in pulls.tolist():
        out[(w, s)] = (v, ids[at:at + n], rows[at:at + n])
        at += n
    return out


def read_server_state(manifest: dict, read: Callable, index: int, mode: str, dims) -> tuple[int, dict]:
    """(version, stale pulls) for server `index` resuming from manifest's checkpoint: the saved push count
    under async (bsp and ssp count steps: the step), and the saved pulls when the workers are the same
    ranks as when it was saved (the same dp x tp x pp and number of servers), else none."""
    servers = len(dims.server_ranks)
    version = read_version(manifest, read, index, servers) if mode == "async" else manifest["step"]
    lay = manifest["layout"]
    same = (lay["dp"], lay["tp"], lay["pp"], lay.get("ps_servers", 0)) == (dims.dp, dims.tp, dims.pp, servers)
    return version, (read_in_flight(manifest, read, index) if same else {})
