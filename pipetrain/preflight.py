"""Pre-flight: refuse, before any allocation, a run that cannot fit or that the corpus cannot feed.

A first estimate, deliberately a lower bound (a refusal must be certain, a pass is not a promise):

    per rank = parameters / (tp * pp) * (4 weights + 4 gradients + 8 AdamW moments / (dp if ZeRO))
             + activations of min(pp, microbatches) microbatches in flight
               (B_micro * T * (10 D + 3 F) / tp * 4 bytes per layer of the stage, plus the logits and
               their gradient, B_micro * T * V / tp * 4 * 2)

against the device's memory: CUDA total memory; on CPU MemAvailable from /proc/meminfo shared by
this node's processes. Parameters are counted on a meta-device build (no memory). A global batch
larger than the corpus's training windows is refused too (it would repeat windows inside a step).
"""
from __future__ import annotations

import codecs
import dataclasses
import os

import torch

from pipetrain.config import ConfigError, Recipe
from pipetrain.build import _build_tokenizer
from pipetrain.data import build_data, is_prepared, prepared_dir_for, sources_of
from pipetrain.data.corpus import source_files
from pipetrain.parallel.mesh.rules import resolve_dp
from pipetrain.plan.memory import model_params

GB = 1e9


def device_memory(world_size: int) -> tuple[float, str]:
    """(bytes one rank may use, where the number comes from)."""
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", 0))
        return float(torch.cuda.get_device_properties(index).total_memory), f"CUDA device {index} total memory"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return float("inf"), "unknown (no /proc/meminfo)"
    return kb * 1024.0 / local, f"MemAvailable {kb * 1024 / GB:.1f} GB / {local} process(es) on this node"


def preflight(recipe: Recipe, world_size: int) -> None:
    """ConfigError (exit 2) naming the key, the need and what is available when the run cannot fit in
    memory or its global batch exceeds the corpus's training windows."""
    check_model_fits(recipe, world_size)
    _check_data(recipe)


def check_model_fits(recipe: Recipe, world_size: int) -> None:
    """The memory half of preflight: arithmetic on the recipe alone (nothing is built), so a recipe of a
    million layers is refused at once."""
    m, p, t = recipe.model, recipe.parallel, recipe.train
    dp = resolve_dp(recipe, world_size)
    params = model_params(m)
    per_rank = params / (p.tp * p.pp)
    state = per_rank * (4 + 4 + 8 / (dp if p.zero >= 1 else 1))
    micro = max(1, t.global_batch // dp // p.microbatches)
    tokens = micro * t.seq_len
    layers = -(-m.n_layers // p.pp)
    activations = (min(p.pp, p.microbatches) * tokens * layers * (10 * m.d_model + 3 * m.ffn_hidden) * 4 / p.tp
                   + tokens * m.vocab_size / p.tp * 4 * 2)
    available, source = device_memory(world_size)
    if state > available:
        raise ConfigError(f"model.d_model={m.d_model}, model.n_layers={m.n_layers}: {params:,} parameters need "
                          f"{state / GB:,.1f} GB per rank for weights, gradients and AdamW state "
                          f"(tp={p.tp}, pp={p.pp}, zero={p.zero}), but {available / GB:,.1f} GB is available ({source}); shrink the model "
                          "or raise parallel.tp, parallel.pp or parallel.zero")
    if state + activations > available:
        raise ConfigError(f"train.global_batch={t.global_batch}: a microbatch of {micro} x {t.seq_len} tokens needs "
                          f"about {activations / GB:,.1f} GB of activations per rank on top of {state / GB:,.1f} GB of "
                          f"weights and optimizer state, but {available / GB:,.1f} GB is available ({source}); lower "
                          "train.global_batch or train.seq_len, or raise parallel.microbatches")


def _check_data(recipe: Recipe) -> None:
    """The data half of preflight: a global batch the corpus's training windows can supply."""
    t = recipe.train
    # the windows: opening the prepared corpus is cheap (memory-mapped); preparing it now is work the
    # loader would do anyway. Its checksums are verified once, by the loader.
    tokenizer = _build_tokenizer(recipe)  # build's tokenizer rules (vocab size) come before preparing data
    for where, path, _ in sources_of(recipe.data):
        if not is_prepared(prepared_dir_for(path, recipe.data.text_field, tokenizer, recipe.data.cache_dir)):
            check_utf8(path, where)
    data = build_data(dataclasses.replace(recipe.data, verify=False), tokenizer, t.seq_len,
                      prepare_missing=int(os.environ.get("LOCAL_RANK", 0)) == 0)
    if t.global_batch > data.num_train_windows:
        raise ConfigError(f"train.global_batch={t.global_batch} needs {t.global_batch:,} training windows per step, "
                          f"but the data gives {data.num_train_windows:,} windows of train.seq_len={t.seq_len}; lower "
                          "train.global_batch or add data")


def check_utf8(path: str, where: str) -> None:
    """ConfigError naming the file and offset when a raw .txt/.jsonl source is not UTF-8 (one streaming read)."""
    builder, files = source_files(path, where)
    if builder not in ("text", "json"):
        return
    for file in files:
        decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                try:
                    decoder.decode(block)
                except UnicodeDecodeError as exc:
                    at = offset + exc.start - (len(exc.object) - len(block))  # exc.object: pending bytes + block
                    raise ConfigError(f"{where}: {file} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at "
                                      f"offset {at}); convert it, e.g. iconv -f latin1 -t utf-8") from None
                offset += len(block)
            try:
                decoder.decode(b"", final=True)
            except UnicodeDecodeError:
                raise ConfigError(f"{where}: {file} is not UTF-8 text (it ends inside a multi-byte character); "
                                  "convert it, e.g. iconv -f latin1 -t utf-8") from None
