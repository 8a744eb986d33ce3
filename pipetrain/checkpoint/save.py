"""Saving a checkpoint: what each process owns and writes, taken as one snapshot per step.

The contract (Saveable): whatever is saved, a trainer rank or a parameter server, hands the Checkpointer
its step, a list of items (global name, local tensor, global shape, offsets of the local box in the
global tensor) and, on rank 0, the run state the manifest records (tokens seen, the data position). Each
brings its own state to the step boundary first (a trainer announces the save to the parameter servers
and drains relaxed replicas). The Checkpointer adds each process's RNG state, copies the items to host
buffers under checkpoint.async, and hands the snapshot to the writer (checkpoint/writer.py).

What a trainer rank owns (owned_tensors): model shards once per (tp, pp) coordinate (dp rank 0;
tensors replicated over tp only from tp rank 0; under expert parallelism each ep rank's experts from
its expert-dp rank 0, as row boxes of the global (E, ...) tensors) and its optimizer state (ZeRO shards from every dp
rank; each relaxed replica's own state from its first dp_shard rank).

RNG: the model has no dropout, so the only consumer of torch's RNG is end-of-run sampling. Each
process's CPU (and CUDA) generator state is saved; load.py restores it for the same layout.

May import: models, parallel.data.grads, checkpoint.manifest, checkpoint.read, checkpoint.writer.
Never: trainer, build, cli.
"""
from __future__ import annotations

import os
from typing import Protocol

import torch

from pipetrain.checkpoint.manifest import FORMAT_VERSION
from pipetrain.checkpoint.read import base_reference, slice_offsets
from pipetrain.checkpoint.writer import CheckpointWriter, Snapshot
from pipetrain.models.init import param_layout, persistent_buffers
from pipetrain.parallel.data.grads import expert_param_ids, tied_copy_names

Item = tuple[str, torch.Tensor, tuple, list[int]]  # (global name, local tensor, global shape, box offsets)


class Saveable(Protocol):
    """What a Checkpointer saves: a trainer rank (pipetrain.trainer.Trainer) and a parameter server
    (pipetrain.parallel.ps.server.Server) provide it the same way."""

    def checkpoint_state(self, trainable_only: bool) -> tuple[int, list[Item], dict]:
        """(step, items, meta), called by every process at the same save. trainable_only: only parameters
        that train (LoRA's adapters, not the frozen base). meta: {"tokens": int, "data": the loader's
        state}, which rank 0 writes into the manifest; a process that is never rank 0 may return {}."""


def owned_tensors(model, optimizer, dims, trainable_only: bool = False) -> list[Item]:
    """(global name, local tensor, global shape, offsets) of everything this trainer rank writes
    (trainable_only: only parameters that train, i.e. LoRA's adapters, not the frozen base)."""
    out = []
    trains = {name: p.requires_grad for name, p in model.named_parameters()}  # the averages below are no parameters
    params = dict(model.named_parameters())
    # local_sgd / diloco: model/ holds the replicas' average, each replica's own under optim/replica<r>/
    params.update(getattr(optimizer, "checkpoint_params", dict)())
    skip = tied_copy_names(model)
    replicated_over_tp = set()
    # ep > 1: the ep ranks hold different experts, so each expert is written by its first expert-dp rank
    ep_ids = expert_param_ids(model) if getattr(dims, "ep", 1) > 1 else set()
    experts = {name for name, p in params.items() if id(p) in ep_ids}

    def first_holder(name: str) -> bool:
        return (dims.expert_dp_rank if name in experts else dims.dp_rank) == 0

    for name, (shape, slices) in param_layout(model).items():
        if tuple(params[name].shape) == tuple(shape):
            replicated_over_tp.add(name)
        if name in skip or not first_holder(name) or (dims.tp_rank != 0 and name in replicated_over_tp):
            continue
        if trainable_only and not trains[name]:
            continue
        out.append((f"model/{name}", params[name].detach(), tuple(shape), slice_offsets(shape, slices)))
    if hasattr(optimizer, "param_items"):  # ZeRO-3: the weights are row shards, written by every dp_shard rank
        out = [(f"model/{name}", t.detach(), shape, list(offsets))  # of the first replica (HSDP: the others
               for name, t, shape, offsets in optimizer.param_items(trainable_only)  # hold the same rows)
               if not (dims.tp_rank != 0 and name in replicated_over_tp)
               and getattr(dims, "dp_replicate_rank", 0) == 0]
    if dims.dp_rank == 0 and dims.tp_rank == 0:  # replicated state (the MoE router's aux-free bias)
        out += [(f"buffer/{name}", b.detach(), tuple(b.shape), [0] * b.dim())
                for name, b in persistent_buffers(model).items()]
    for name, tensor, shape, offsets in optimizer.state_items():
        param_name = name.rsplit("/", 1)[-1]
        if param_name in skip or (dims.tp_rank != 0 and param_name in replicated_over_tp):
            continue
        sharded_over_dp = getattr(optimizer, "stage", 0) >= 1  # ZeRO: every dp rank owns a row shard
        if name.startswith("replica") and "/" in name:  # one replica's own state: written by each replica
            if dims.dp_shard_rank != 0 and (not sharded_over_dp or tensor.dim() == 0):
                continue
        elif not (first_holder(param_name) if tensor.dim() else dims.dp_rank == 0) and not sharded_over_dp:
            continue
        elif dims.dp_rank != 0 and tensor.dim() == 0:
            continue
        elif sharded_over_dp and getattr(dims, "dp_replicate_rank", 0) != 0:  # replicas hold the same rows
            continue
        out.append((f"optim/{name}", tensor.detach(), tuple(shape), list(offsets)))
    return out


class Checkpointer:
    """Saves a Saveable every checkpoint.every steps, at the end and on SIGTERM. With checkpoint.async,
    save() takes a host snapshot and returns; a background thread writes it (at most one save in
    flight: the next save, or the end of the run, waits for the previous one first)."""

    def __init__(self, output_dir: str, recipe, dims):
        self.recipe, self.dims = recipe, dims
        self.writer = CheckpointWriter(os.path.join(output_dir, "checkpoints"), dims, recipe.checkpoint.keep)
        self.adapters_only = recipe.model.lora_rank is not None  # LoRA: the adapters plus a base reference
        self.base: dict | None = None  # base_reference(recipe), hashed once at the first save
        self.is_async = recipe.checkpoint.async_
        self._buffers: dict[str, torch.Tensor] = {}  # async: host copies, reused from save to save

    def save(self, source: Saveable) -> str:
        """Write the checkpoint of source's step on every process (under checkpoint.async: snapshot it and
        start writing it in the background; wait() finishes it). An OSError on any rank (no space,
        permissions, quota) raises CheckpointSaveError on every rank, naming the path and the free
        space, after rank 0 removed the temporary folder: the previous checkpoint stays `latest`.
        A stray non-directory where a checkpoint folder goes is a ConfigError."""
        self.wait()  # at most one save in flight
        step, items, meta = source.checkpoint_state(self.adapters_only)
        snap = self._snapshot(step, items, meta, copy=self.is_async)
        if self.is_async:
            return self.writer.start(snap, self._manifest)
        return self.writer.write(snap, self._manifest)

    @property
    def in_flight(self) -> bool:
        return self.writer.in_flight

    @property
    def failed(self) -> bool:
        """The background save ended with an error (every rank's writer learns of any rank's failure)."""
        return self.writer.failed

    def wait(self) -> None:
        """Finish the save in flight, if any; raise its error here, on the training thread."""
        self.writer.wait()

    def _snapshot(self, step: int, items: list[Item], meta: dict, copy: bool) -> Snapshot:
        if copy:  # host copies: the next steps change the originals while the writer runs
            items = [(n, self._host_copy(n, t), g, o) for n, t, g, o in items]
            if self.dims.device.type == "cuda":  # the device-to-pinned copies were asynchronous
                torch.cuda.synchronize(self.dims.device)
        rng = {"rng/cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["rng/cuda"] = torch.cuda.get_rng_state(self.dims.device)
        return Snapshot(step, meta, items, rng)

    def _host_copy(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """tensor copied into this name's host buffer, allocated at the first async save and reused after
        (the previous write has finished: one save in flight), so later snapshots pay no page faults."""
        buf = self._buffers.get(name)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            buf = self._buffers[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                                              pin_memory=tensor.is_cuda)
        return buf.copy_(tensor.detach(), non_blocking=tensor.is_cuda)

    def _manifest(self, snap: Snapshot, entries: list[dict]) -> dict:
        """Rank 0: the manifest of snap from every process's file entry (the writer seals it)."""
        tensors: dict[str, dict] = {}
        for e in entries:
            for piece in e["pieces"]:
                t = tensors.setdefault(piece["name"], {"global_shape": piece["global_shape"], "dtype": piece["dtype"],
                                                       "pieces": []})
                t["pieces"].append({"file": e["file"], "offsets": piece["offsets"], "shape": piece["shape"]})
        d = self.dims
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": snap.step,
            "tokens": snap.meta["tokens"],
            "recipe": self.recipe.to_dict(),
            "layout": {"dp": d.dp, "tp": d.tp, "pp": d.pp, "cp": d.cp, "zero": self.recipe.parallel.zero,
                       "virtual_stages": self.recipe.parallel.virtual_stages, "world_size": d.world_size,
                       "dp_shard": d.dp_shard, "dp_replicate": d.dp_replicate,
                       "dp_sync": self.recipe.parallel.dp_sync,
                       "ps_servers": d.ps_servers},
            "tensors": tensors,
            "files": {e["file"]: {"sha256": e["sha256"], "bytes": e["bytes"]} for e in entries},
            "rng": {str(e["rank"]): e["file"] for e in entries},
            "data": snap.meta["data"],
            "lr_schedule": {"step": snap.step, "name": self.recipe.train.lr_schedule,
                            "warmup_steps": self.recipe.train.warmup_steps},
        }
        if self.adapters_only:
            self.base = self.base or base_reference(self.recipe.model.init_from, self.recipe.train.seed)
            manifest["base"] = self.base
        return manifest
