"""Pre-flight: refuse, before any allocation, a run that cannot fit or that the corpus cannot feed.

Memory: the planner's model (pipetrain.plan.memory.run_memory, the same per-rank figures --dry-run and
parallel.auto report) for every pp rank and every parameter server, against what the rank may use: a
worker's device (CUDA total memory; on CPU MemAvailable from /proc/meminfo shared by this node's
processes), a server's host memory (MemAvailable likewise). A refusal must be certain and a pass is no
promise: the model is documented within MARGIN of measured peaks (docs/planner.md), so a rank is refused
only when even its estimate less MARGIN exceeds what it has. The model is arithmetic on the recipe
(nothing is built), so a recipe of a million layers is refused at once. A global batch larger than the
corpus's training windows is refused too (it would repeat windows inside a step).
"""
from __future__ import annotations

import dataclasses
import os

import torch

from pipetrain.config import ConfigError, Recipe
from pipetrain.build import _build_tokenizer
from pipetrain.data import build_data, is_prepared, prepared_dir_for, sources_of
from pipetrain.data.checks import check_utf8
from pipetrain.data.sources import source_files
from pipetrain.plan.devices import load_profile
from pipetrain.plan.memory import RankMemory, run_memory
from pipetrain.plan.shapes import model_params
from pipetrain.plan.search import state_floor

GB = 1e9


MARGIN = 0.15  # the memory model's documented accuracy against measured peaks (docs/planner.md)


def host_memory(world_size: int) -> tuple[float, str]:
    """(bytes of host memory one process of this node may use, where the number comes from)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return float("inf"), "unknown (no /proc/meminfo)"
    return kb * 1024.0 / local, f"MemAvailable {kb * 1024 / GB:.1f} GB / {local} process(es) on this node"


def device_memory(world_size: int) -> tuple[float, str]:
    """(bytes one worker rank may use, where the number comes from). PIPETRAIN_DEVICE (a DEVICES name or
    profile file) overrides the device, as it does for parallel.auto (plan.auto.launch_profile): a dry run
    on a laptop then checks the layout against the cards it is meant for."""
    if os.environ.get("PIPETRAIN_DEVICE"):
        profile = load_profile(os.environ["PIPETRAIN_DEVICE"], "PIPETRAIN_DEVICE")
        return profile.memory_bytes, f"{profile.name}, from PIPETRAIN_DEVICE"
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", 0))
        return float(torch.cuda.get_device_properties(index).total_memory), f"CUDA device {index} total memory"
    return host_memory(world_size)


def preflight(recipe: Recipe, world_size: int) -> None:
    """ConfigError (exit 2) naming the key, the need and what is available when the run cannot fit in
    memory or its global batch exceeds the corpus's training windows."""
    check_model_fits(recipe, world_size)
    _check_data(recipe)


def memory_estimate(recipe: Recipe, world_size: int) -> list[RankMemory]:
    """run_memory for the device the run is checked against (device_memory's): PIPETRAIN_DEVICE's profile, else
    this machine's, CUDA or the CPU (gloo there stages its collectives' outputs; the CPU runs the torch
    references, CUDA the Triton kernels, which keep less for backward)."""
    if os.environ.get("PIPETRAIN_DEVICE"):
        profile = load_profile(os.environ["PIPETRAIN_DEVICE"], "PIPETRAIN_DEVICE")
        staged, device_type = profile.staged_collectives, profile.device_type
    else:
        staged, device_type = not torch.cuda.is_available(), "cuda" if torch.cuda.is_available() else "cpu"
    return run_memory(recipe, world_size, staged_collectives=staged, device_type=device_type)


def check_model_fits(recipe: Recipe, world_size: int) -> list[RankMemory]:
    """The memory half of preflight; returns the estimate it checked (every pp rank, then every server).
    world_size: the mesh's ranks (servers excluded)."""
    m, p, t = recipe.model, recipe.parallel, recipe.train
    processes = world_size + p.ps_servers
    # the planner's floor first (model states spread evenly over every rank: certain, and arithmetic on
    # the parameter count alone), so a model far too big is refused before any stage split is computed;
    # not with parameter servers, whose table is no worker's
    available, source = device_memory(processes)
    floor = 0.0 if p.ps_servers else state_floor(recipe, world_size)
    if floor > available:
        raise ConfigError(f"model.d_model={m.d_model}, model.n_layers={m.n_layers}: {model_params(m):,} parameters "
                          f"need at least {floor / GB:,.1f} GB per rank for weights, gradients and AdamW state "
                          f"even spread over all {world_size} ranks, but {available / GB:,.1f} GB is available "
                          f"({source}); shrink the model or launch more ranks")
    estimate = memory_estimate(recipe, world_size)
    for r in estimate:
        server = r.role == "server"
        available, source = host_memory(processes) if server else device_memory(processes)
        who = f"parameter server {r.pp_rank}" if server else f"pp rank {r.pp_rank}"
        if r.model_states * (1 - MARGIN) > available:
            raise ConfigError(f"model.d_model={m.d_model}, model.n_layers={m.n_layers}: {model_params(m):,} "
                              f"parameters need {r.model_states / GB:,.1f} GB per rank ({who}) for weights, "
                              f"gradients and AdamW state (tp={p.tp}, pp={p.pp}, zero={p.zero}), but "
                              f"{available / GB:,.1f} GB is available ({source}); shrink the model or raise "
                              "parallel.tp, parallel.pp or parallel.zero" + (" or parallel.ps_servers" if server else ""))
        if r.total * (1 - MARGIN) > available:
            raise ConfigError(f"train.global_batch={t.global_batch}: {who} needs about {r.total / GB:,.1f} GB at its "
                              f"peak ({r.activations / GB:,.1f} GB of activations on top of "
                              f"{r.model_states / GB:,.1f} GB of weights and optimizer state), but "
                              f"{available / GB:,.1f} GB is available ({source}); lower train.global_batch or "
                              "train.seq_len, or raise parallel.microbatches or parallel.cp")
    return estimate


def _check_data(recipe: Recipe) -> None:
    """The data half of preflight: a global batch the corpus's training windows can supply."""
    t = recipe.train
    # the windows: opening the prepared corpus is cheap (memory-mapped); preparing it now is work the
    # loader would do anyway. Its checksums are verified once, by the loader.
    tokenizer = _build_tokenizer(recipe)  # build's tokenizer rules (vocab size) come before preparing data
    for where, path, _ in sources_of(recipe.data):
        if not is_prepared(prepared_dir_for(path, recipe.data.text_field, tokenizer, recipe.data.cache_dir)):
            check_utf8(source_files(path, where)[1], where)  # every rank, before the local rank 0 prepares
    data = build_data(dataclasses.replace(recipe.data, verify=False), tokenizer, t.seq_len,
                      prepare_missing=int(os.environ.get("LOCAL_RANK", 0)) == 0)
    if t.global_batch > data.num_train_windows:
        raise ConfigError(f"train.global_batch={t.global_batch} needs {t.global_batch:,} training windows per step, "
                          f"but the data gives {data.num_train_windows:,} windows of train.seq_len={t.seq_len}; lower "
                          "train.global_batch or add data")
