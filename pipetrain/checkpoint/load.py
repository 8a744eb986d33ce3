"""Loading a checkpoint into this rank's objects, in any layout, and choosing which one to resume.

Loading assembles, for each tensor a rank holds, the box it needs from whichever saved pieces overlap
it (checkpoint/read.py's TensorReader reads only those slices), so a checkpoint saved with one layout
loads into any other. A checkpoint of another model is refused (check_compatible), and LoRA adapters
load only onto the base they were trained on (check_base).

RNG: a resume with the same layout restores each rank's generator state exactly; a resume into another
layout cannot map rank streams one to one, so each rank reseeds from (train.seed, step, rank).

Which checkpoint: find_resumable (rank 0, cheap checks only); resume.py makes every process agree on the
outcome of loading it. May import: config, models, parallel.data.grads, checkpoint.read. Never:
trainer, build, cli.
"""
from __future__ import annotations

import os
import sys

import torch

from pipetrain.checkpoint.read import (TensorReader, base_reference, checkpoint_dirs, read_manifest,
                                       slice_offsets, verify_files)
from pipetrain.config import ConfigError
from pipetrain.models.init import param_layout, persistent_buffers
from pipetrain.parallel.data.grads import tied_copy_names

# Keys named in the refusal when they differ (lora_rank: adapters only load into adapters); every other key that
# sets a tensor's shape (head_dim, moe_intermediate_size, gpt2's max_seq_len) is caught by the shapes themselves
# (TensorReader.read's global_shape), which name the tensor.
_ARCH_KEYS = ("family", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden",
              "tie_embeddings", "qkv_bias", "lora_rank", "num_experts", "shared_expert_intermediate_size")
# keys that change what the saved weights compute without changing a tensor: a resume may change them on purpose
# (a longer context's rope_theta), so they are named in a note rather than refused
_FUNCTION_KEYS = ("rope_theta", "norm_eps", "sliding_window", "num_experts_per_tok", "norm_topk_prob", "lora_alpha")


def check_resume_dir(path: str) -> None:
    """ConfigError unless `--resume DIR` names a folder."""
    if not os.path.isdir(path):
        raise ConfigError(f"--resume {path}: no such checkpoint directory; pass a checkpoints/step-... folder or "
                          "--resume auto")


def find_resumable(output_dir: str, rank: int = 0, *, older_than: str | None = None) -> str | None:
    """Newest checkpoint in output_dir/checkpoints (older than the folder older_than names, when given)
    whose manifest is sealed and well formed and whose files' headers and sizes match it; reports and
    skips the others. None when there is none. Nothing is hashed here: a checkpoint may be far larger
    than one rank can hash within a collective's timeout, so each rank hashes the files it reads when
    it loads them (pipetrain.checkpoint.resume agrees on the outcome)."""
    paths = checkpoint_dirs(os.path.join(output_dir, "checkpoints"))[::-1]
    if older_than is not None:
        paths = [p for p in paths if os.path.basename(p) < os.path.basename(os.path.normpath(older_than))]
    for path in paths:
        try:
            verify_files(path, read_manifest(path), sha256=False)
            return path
        except ConfigError as exc:
            if rank == 0:
                print(f"warning: skipping checkpoint {path}: {exc}", file=sys.stderr)
    return None


def check_compatible(manifest: dict, recipe, ckpt_dir: str) -> None:
    """ConfigError unless the checkpoint's model architecture is the recipe's (any layout may differ)."""
    saved = manifest["recipe"]["model"]
    now = recipe.to_dict()["model"]
    diffs = [f"model.{k}: checkpoint {saved.get(k)!r} vs recipe {now.get(k)!r}" for k in _ARCH_KEYS
             if saved.get(k) != now.get(k)]
    if diffs:
        raise ConfigError(f"checkpoint {ckpt_dir} does not match the recipe's model ({'; '.join(diffs)}); "
                          "resume with the recipe it was saved with")


def function_changes(manifest: dict, recipe) -> list[str]:
    """The _FUNCTION_KEYS whose value differs between the checkpoint's recipe and this one ("model.k: a there,
    b now"), in the resolved form the checkpoint keeps."""
    saved, now = manifest["recipe"]["model"], recipe.to_dict()["model"]
    return [f"model.{k}: {saved.get(k)!r} there, {now.get(k)!r} now" for k in _FUNCTION_KEYS
            if k in saved and saved.get(k) != now.get(k)]


def check_base(manifest: dict, init_from: str | None, seed: int, ckpt_dir: str) -> None:
    """An adapter-only checkpoint loads only onto the base it was trained on (ConfigError otherwise)."""
    saved, now = manifest["base"], base_reference(init_from, seed)
    if saved.get("sha256") != now.get("sha256") or saved.get("seed") != now.get("seed"):
        raise ConfigError(f"checkpoint {ckpt_dir} holds LoRA adapters trained on base {saved}, got base {now}; "
                          "set model.init_from (and train.seed) to the base the adapters were trained on")


def load(ckpt_dir: str, trainer_parts: dict, recipe, dims) -> dict:
    """Restore model, optimizer, data position and RNG into this rank's objects; returns the manifest.
    trainer_parts: {"model", "optimizer", "loader"}."""
    manifest = read_manifest(ckpt_dir)
    check_compatible(manifest, recipe, ckpt_dir)
    changed = function_changes(manifest, recipe)
    if changed and dims.rank == 0:
        print(f"note: resuming {ckpt_dir} with {'; '.join(changed)}: the saved weights now compute another "
              "function than they were trained for", file=sys.stderr, flush=True)
    # checksums: each file this rank reads is hashed once before use (docs/checkpoints.md)
    reader = TensorReader(ckpt_dir, manifest, device=dims.device, verify=recipe.checkpoint.verify)
    model, optimizer, loader = trainer_parts["model"], trainer_parts["optimizer"], trainer_parts["loader"]
    params = dict(model.named_parameters())
    adapters_only = "base" in manifest  # LoRA: the frozen base came from init_from or the seed
    if adapters_only:
        check_base(manifest, recipe.model.init_from, recipe.train.seed, ckpt_dir)
    if hasattr(optimizer, "load_param_items"):  # ZeRO-3: only this rank's rows of each weight are held
        optimizer.load_param_items(lambda name, global_shape, offsets, shape:
                                   reader.read(f"model/{name}", offsets, shape, global_shape=global_shape),
                                   adapters_only)
    else:
        _load_params(model, params, reader, adapters_only)
    load_buffers(model, reader, manifest)
    optimizer.load_state_items(lambda name, global_shape, offsets, shape:
                               reader.read(f"optim/{name}", offsets, shape, global_shape=global_shape))
    loader.load_state_dict(manifest["data"])
    layout = manifest["layout"]
    same = (layout["dp"], layout["tp"], layout["pp"], layout.get("cp", 1), layout.get("ps_servers", 0)) == \
        (dims.dp, dims.tp, dims.pp, dims.cp, dims.ps_servers)
    if same:
        rng_file = reader.open_file(manifest["rng"][str(dims.rank)])
        torch.set_rng_state(rng_file.get_tensor("rng/cpu"))
        if torch.cuda.is_available() and "rng/cuda" in rng_file.keys():
            torch.cuda.set_rng_state(rng_file.get_tensor("rng/cuda"), dims.device)
    else:
        torch.manual_seed(recipe.train.seed * 1_000_003 + manifest["step"] * 1009 + dims.rank)
    return manifest


def _load_params(model, params: dict, reader: TensorReader, adapters_only: bool) -> None:
    """Copy each parameter's box (its tp / pp slice) from the checkpoint into the model."""
    with torch.no_grad():
        for name, (shape, slices) in param_layout(model).items():
            if adapters_only and not params[name].requires_grad:
                continue
            saved_name = "model/embed.weight" if name in tied_copy_names(model) else f"model/{name}"
            p = params[name]
            p.copy_(reader.read(saved_name, slice_offsets(shape, slices), p.shape, p.dtype, global_shape=shape))


def load_buffers(model, reader: TensorReader, manifest: dict) -> None:
    """The model's persistent buffers (a MoE router's aux-free bias) from buffer/ (training resumes and
    whole-model reads both need them: the bias decides which experts a token goes to). A checkpoint from
    before a buffer existed leaves it at its initial value."""
    with torch.no_grad():
        for name, b in persistent_buffers(model).items():
            if f"buffer/{name}" in manifest["tensors"]:
                b.copy_(reader.read(f"buffer/{name}", [0] * b.dim(), b.shape, b.dtype, global_shape=b.shape))
