"""A LoRA checkpoint's adapters as a PEFT adapter folder:

    python -m pipetrain.hf export CKPT_DIR OUT_DIR --peft [--dtype fp32|bf16|fp16]

writes adapter_config.json and adapter_model.safetensors, which
peft.PeftModel.from_pretrained(base, OUT_DIR) loads onto the base model (model.init_from, loaded with
transformers) with the same logits as pipetrain. Names: our layers.N.attn.wq.lora_A (r, D_in) and
lora_B (D_out, r) become base_model.model.<the base weight's HF name without .weight>.lora_A.weight /
.lora_B.weight (model.layers.N.self_attn.q_proj.lora_A.weight): the same matrices, since PEFT's
LoRA computes lora_B(lora_A(dropout(x))) * lora_alpha / r as pipetrain does. target_modules are the HF
leaf names (q_proj, ..., down_proj). gpt2 is refused: its q/k/v are one fused c_attn Conv1D, which
PEFT adapts as a single module; export such a run merged instead (without --peft).
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from pipetrain.checkpoint.read import checkpoint_model_config, iter_full_tensors, read_manifest, verify_files
from pipetrain.config import ConfigError, ModelConfig
from pipetrain.hf.weights import hf_sources

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


def peft_name(name: str, cfg: ModelConfig) -> str:
    """layers.0.attn.wq.lora_A -> base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"""
    module, leaf = name.rsplit(".", 1)
    hf = hf_sources(cfg)[f"{module}.weight"].hf_name.removesuffix(".weight")
    return f"base_model.model.{hf}.{leaf}.weight"


def export_peft(ckpt_dir: str, out_dir: str, dtype: torch.dtype | None = None) -> list[str]:
    """Write CKPT_DIR's LoRA adapters as a PEFT folder in out_dir (module docstring). dtype None: as saved."""
    manifest = read_manifest(ckpt_dir)
    cfg = checkpoint_model_config(manifest)
    if "base" not in manifest or cfg.lora_rank is None:
        raise ConfigError(f"export --peft: checkpoint {ckpt_dir} was not trained with LoRA, got model.lora_rank="
                          f"{cfg.lora_rank}; export the full model without --peft")
    if cfg.family == "gpt2":
        raise ConfigError("export --peft: gpt2's q/k/v are one fused c_attn module in Hugging Face, got family "
                          "gpt2; export the merged model without --peft")
    verify_files(ckpt_dir, manifest)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"export --peft: OUT {out_dir} is an existing file, got a file where a folder goes; "
                          "name a new folder")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise ConfigError(f"export --peft: {out_dir} is not empty, got {sorted(os.listdir(out_dir))[:5]}; "
                          "export into a new directory")
    os.makedirs(out_dir, exist_ok=True)
    tensors, targets = {}, set()
    for name, tensor in iter_full_tensors(ckpt_dir):
        if name.rsplit(".", 1)[-1] not in ("lora_A", "lora_B"):
            continue
        key = peft_name(name, cfg)
        tensors[key] = tensor.to(dtype or tensor.dtype).contiguous()
        targets.add(key.split(".")[-3])
    save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha,
              "lora_dropout": cfg.lora_dropout, "target_modules": sorted(targets), "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
              "init_lora_weights": True, "modules_to_save": None,
              "base_model_name_or_path": cfg.init_from}
    with open(os.path.join(out_dir, ADAPTER_CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
    return [ADAPTER_WEIGHTS_FILE, ADAPTER_CONFIG_FILE]
