"""Full single-device models for generation: from a pipetrain checkpoint (any layout), a run
directory (its newest checkpoint) or a Hugging Face model folder, with the matching tokenizer."""
from __future__ import annotations

import os

import torch
import torch.nn as nn

from pipetrain.checkpoint.load import find_resumable, load_buffers
from pipetrain.checkpoint.read import TensorReader, checkpoint_model_config, read_manifest
from pipetrain.config import ConfigError
from pipetrain.data import load_tokenizer
from pipetrain.hf.config import model_config_from_hf
from pipetrain.hf.export import lora_checkpoint_model
from pipetrain.hf.tokenizer import check_tokenizer_vocab
from pipetrain.hf.weights import load_hf_weights
from pipetrain.models import build
from pipetrain.models.init import param_layout
from pipetrain.models.lora import merge_lora
from pipetrain.plan.memory import FP32
from pipetrain.plan.shapes import model_params
from pipetrain.preflight import GB, device_memory, host_memory


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest whole checkpoint under output_dir/checkpoints, as --resume auto picks it (by its step folder,
    sealed and well formed), or None. Not the text of checkpoints/latest: that could name a folder anywhere
    (an absolute path was joined as given and loaded), or hold anything."""
    return find_resumable(output_dir)


@torch.no_grad()
def model_from_checkpoint(ckpt_dir: str, device: torch.device | str = "cpu") -> tuple[nn.Module, dict]:
    """The whole model of a checkpoint saved with any layout (every file checksummed before use),
    and the checkpoint's recipe as a dict."""
    manifest = read_manifest(ckpt_dir)
    recipe = manifest["recipe"]
    if "base" in manifest:  # LoRA: adapters only; their base (init_from or seed) with them merged in
        return merge_lora(lora_checkpoint_model(ckpt_dir, manifest)).to(device).eval(), recipe
    cfg = checkpoint_model_config(manifest)
    model = build(cfg, device="meta")
    model.to_empty(device=device)
    if cfg.tied:  # to_empty() gave the head its own tensor: tie it to the embedding again
        model.head.weight = model.embed.weight
    reader = TensorReader(ckpt_dir, manifest, device=device)
    params = dict(model.named_parameters())
    for name, (shape, _) in param_layout(model).items():
        params[name].copy_(reader.read(f"model/{name}", [0] * len(shape), shape, params[name].dtype))
    load_buffers(model, reader, manifest)
    return model.eval(), recipe


def load_for_generation(path: str, tokenizer_dir: str | None = None,
                        device: torch.device | str = "cpu") -> tuple[nn.Module, object]:
    """(model, tokenizer) from a checkpoint folder, a run folder or a Hugging Face model folder."""
    if not os.path.isdir(path):
        raise ConfigError(f"generate: no such directory, got {path!r}; pass a checkpoints/step-... folder, "
                          "a run folder or a Hugging Face model folder")
    if not os.path.isfile(os.path.join(path, "manifest.json")) and latest_checkpoint(path):
        path = latest_checkpoint(path)  # a run folder: its newest checkpoint
    if os.path.isfile(os.path.join(path, "manifest.json")):
        model, recipe = model_from_checkpoint(path, device)
        if tokenizer_dir is not None and not os.path.isdir(tokenizer_dir):
            raise ConfigError(f"generate: --tokenizer {tokenizer_dir}: no such folder; pass the folder of a "
                              "Hugging Face tokenizer")
        tokenizer_dir = tokenizer_dir or recipe.get("data", {}).get("tokenizer") or recipe["model"].get("init_from")
        if not tokenizer_dir or not os.path.isdir(tokenizer_dir):
            raise ConfigError(f"generate: the tokenizer recorded in {path}'s recipe was not found, got "
                              f"{tokenizer_dir!r}; pass --tokenizer DIR")
    elif os.path.isfile(os.path.join(path, "config.json")):
        cfg = model_config_from_hf(path)
        _check_fits(cfg, path, torch.device(device))
        model = load_hf_weights(build(cfg, device="meta"), path, cfg, device=device).eval()
        tokenizer_dir = tokenizer_dir or path
    else:
        raise ConfigError(f"generate: {path} holds neither manifest.json (a pipetrain checkpoint) nor "
                          "config.json (a Hugging Face model); pass a checkpoints/step-... folder or a model folder")
    tokenizer = load_tokenizer(tokenizer_dir, where="generate --tokenizer")
    check_tokenizer_vocab(tokenizer, model.cfg, where="generate --tokenizer")
    return model, tokenizer


def _check_fits(cfg, path: str, device: torch.device) -> None:
    """ConfigError where the model a config.json describes cannot be held (its fp32 weights, by arithmetic on the
    config, before a layer is built: a million layers hung building, a vocabulary of 1e12 failed to allocate)."""
    need = FP32 * model_params(cfg)
    available, source = device_memory(1) if device.type == "cuda" else host_memory(1)
    if need > available:
        raise ConfigError(f"generate: {path}/config.json describes {model_params(cfg):,} parameters, "
                          f"{need / GB:,.1f} GB in fp32, but {available / GB:,.1f} GB is available ({source}); "
                          "check its sizes (num_hidden_layers, hidden_size, vocab_size, intermediate_size)")
