"""The parameter server's protocol: who holds which rows, the message header, byte counts and versions.

A hybrid parameter server for the input embedding (parallel.ps_servers, parallel.ps_sync). MindSpore's
parameter-server mode keeps big tables on server processes: workers pull the rows they need and push
gradients, the servers run the optimizer, and everything else trains with all-reduce. Here the table is
the untied input embedding (V x d): its gradient touches only the rows of the batch's tokens.

    world = dp x tp x pp workers (the mesh, ranks 0..W-1) + S servers (ranks W..W+S-1)

Server i holds rows row_range(V, S, i) (ps/server.py); the workers' side is ps/client.py.

Transport: torch.distributed point-to-point on a gloo group of pushers and servers (dims.ps_group),
also on GPU machines, so every tensor here is on the CPU (PS_DEVICE). A message is a fixed header
[op, step, n, aux] then its payload; a server receives headers from any source and serves them in
arrival order, answering each worker's pulls in the order it asked them.

Consistency (parallel.ps_sync), by the oldest server version a pull may see (required_version):
- bsp: every update before the step: the all-reduce run's update, to summation-order round-off;
- ssp: all but the newest parallel.staleness updates (workers run up to s steps ahead);
- async: anything; each push is applied when it arrives.
"""
from __future__ import annotations

import math

import torch

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


def header(op: int, step: int = 0, n: int = 0, aux: int = 0) -> torch.Tensor:
    """A message's header: [op, step, n (payload rows), aux (a version)]."""
    return torch.tensor([op, step, n, aux], dtype=torch.int64, device=PS_DEVICE)
