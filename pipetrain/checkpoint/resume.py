"""Loading the checkpoint a run resumes from, with every process agreeing on the outcome.

A checkpoint of 100 GB cannot be hashed by one rank while every other rank waits in a collective: the
wait passes the process group's timeout. So the checks are split by cost. Rank 0 checks what is cheap
for the whole checkpoint (pipetrain.checkpoint.load.find_resumable: the sealed manifest, its structure,
every file's safetensors header and size) and broadcasts its choice; then each rank hashes only the
files it reads, the first time it reads from each (checkpoint.read.TensorReader), so the hashing is spread over the
ranks and no rank hashes a file it does not read.

A file a rank finds damaged while loading must still move every rank: after each attempt the
processes (parameter servers included) agree on an outcome code by an all-reduce (maximum) of a CPU
tensor on the gloo checkpoint group (pipetrain.parallel.mesh.comm). Any rank's damage sends all of them to
the next older checkpoint that rank 0 finds intact (`--resume auto`), or to one error when none is
left or the checkpoint was named (`--resume DIR`). Any other refusal (a checkpoint of another model)
or error stops every rank, instead of leaving the others waiting in the next collective. Falling back
reloads everything: each load overwrites every parameter, optimizer tensor, the data position and
the RNG, so nothing of the damaged attempt remains.

May import: checkpoint, config, parallel.mesh. Never: trainer, build, cli.
"""
from __future__ import annotations

import os
import sys
from typing import Callable, TypeVar

import torch

from pipetrain.checkpoint.load import find_resumable
from pipetrain.checkpoint.read import CorruptCheckpoint
from pipetrain.config import ConfigError
from pipetrain.parallel.mesh.comm import all_reduce_max_, broadcast_object_from_rank0

T = TypeVar("T")
# Outcome codes of one attempt, agreed by their maximum: a refusal outranks damage, damage outranks success.
LOADED, DAMAGED, REFUSED = 0, 1, 2


def load_agreed(ckpt_dir: str, load_one: Callable[[str], T], dims, *, auto: bool,
                output_dir: str) -> tuple[str, T]:
    """(checkpoint loaded, load_one's result): load_one(ckpt_dir) on every process, then again on the next
    older intact checkpoint for as long as any process found its files damaged (auto; otherwise, and when
    none is left, every process raises). Every process calls this at the same point, servers included."""
    group = dims.checkpoint_group()  # gloo, every process: the collectives below need CPU tensors
    while True:
        result, error, outcome = None, None, LOADED
        try:
            result = load_one(ckpt_dir)
        except CorruptCheckpoint as exc:
            error, outcome = exc, DAMAGED
        except Exception as exc:  # noqa: BLE001 - re-raised below once agreed, so no rank waits on a failed one
            error, outcome = exc, REFUSED
        agreed = int(all_reduce_max_(torch.tensor([outcome], dtype=torch.int64, device="cpu"), group).item())
        if agreed == LOADED:
            return ckpt_dir, result
        if agreed == REFUSED or not auto:
            raise error or ConfigError(f"checkpoint {ckpt_dir}: another rank refused it (its error above says why); "
                                       "resume from another checkpoint")
        if error is not None:
            print(f"warning: {dims.coords} skipping checkpoint {ckpt_dir}: {error}", file=sys.stderr, flush=True)
        failed = ckpt_dir
        ckpt_dir = broadcast_object_from_rank0(
            find_resumable(output_dir, dims.rank, older_than=failed) if dims.rank == 0 else None,
            dims.full_world_size)
        if ckpt_dir is None:
            root = os.path.join(output_dir, "checkpoints")
            raise ConfigError(f"--resume auto: no intact checkpoint is left in {root} ({os.path.basename(failed)} "
                              "and any newer failed verification, see the warnings); restore a good copy, or move "
                              "the checkpoints away to start fresh")
        if dims.rank == 0:
            print(f"--resume auto: {os.path.basename(failed)} is damaged; every rank falls back to {ckpt_dir}",
                  file=sys.stderr, flush=True)
