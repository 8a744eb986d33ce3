"""Hugging Face export: full tensors by our global names -> config.json + safetensors + tokenizer.

    python -m pipetrain.hf export CKPT_DIR OUT_DIR [--max-shard-size 2GB] [--dtype fp32|bf16|fp16]
                                                   [--tokenizer DIR] [--peft]

writes a directory that transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR) loads with the
same logits as pipetrain. A LoRA checkpoint (adapters plus a base reference) is exported merged:
base weights (model.init_from or the seed) with W + (alpha / r) B A folded in; with --peft, only the
adapters as a PEFT folder instead (pipetrain.hf.peft_export).

A complete model folder: the tokenizer files (its chat template included: tokenizer_config.json's
chat_template or chat_template.jinja), generation_config.json (copied from model.init_from when it
has one, else written with the tokenizer's bos / eos / pad ids, pad falling back to eos), and the
weights in the source dtype by default (model.init_from's config.json dtype; fp32 for a model
trained from scratch), or --dtype. The name mapping is the inverse of pipetrain.hf.weights.hf_sources (GPT-2's
q/k/v are fused into c_attn and Linear weights transposed into Conv1D's (in, out) layout).

Streaming: every output tensor's name, shape and dtype follow from the ModelConfig alone, so the
safetensors headers (and the shard each tensor goes to) are written before any data arrives; each
incoming tensor is then converted and written at its offset and dropped. Peak memory is about one
tensor (plus its dtype-converted/transposed copy); GPT-2's c_attn holds q, k and v until all three
have arrived. Output files above max_shard_bytes are split as transformers does:
model-0000i-of-0000n.safetensors plus model.safetensors.index.json. config.json is written last, so
an interrupted export never looks loadable.

Architecture chosen for the structure (an exact equivalent when the family's own class lacks it):
gpt2 -> GPT2LMHeadModel; q/k/v biases -> Qwen2ForCausalLM; a sliding window -> MistralForCausalLM;
otherwise llama -> LlamaForCausalLM, mistral -> MistralForCausalLM, qwen2 (no bias) -> LlamaForCausalLM;
mixtral -> MixtralForCausalLM, qwen3_moe -> Qwen3MoeForCausalLM (experts fused as transformers 5 stores them).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
from fractions import Fraction
from typing import Iterable, Iterator, Mapping

import torch
import torch.nn as nn

from pipetrain.checkpoint.load import check_base
from pipetrain.checkpoint.read import (TensorReader, checkpoint_model_config, iter_full_tensors, read_manifest,
                                      verify_files)
from pipetrain.config import ArgumentParser, ConfigError, ModelConfig
from pipetrain.hf.config import CONFIG_FILE, FAMILIES as FAMILY_CLASS, read_hf_config
from pipetrain.hf.peft_export import export_peft
from pipetrain.hf.tokenizer import load_hf_tokenizer
from pipetrain.hf.weights import INDEX_FILE, WEIGHTS_FILE, hf_shapes, hf_sources, load_hf_weights
from pipetrain.models import build, materialize, param_layout
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.models.lora import is_adapter, merge_lora
from pipetrain.parallel.tensor.lora import apply_lora

DEFAULT_MAX_SHARD_BYTES = 2 * 10**9  # transformers' own default for save_pretrained ("2GB", decimal)
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
CLI_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
GENERATION_CONFIG_FILE = "generation_config.json"
HF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")


def parse_size(text: str) -> int:
    """'2GB' -> 2e9, '500MiB' -> 500*2**20, '1000' -> 1000 bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    if not m:
        raise ConfigError(f"--max-shard-size: expected a size such as 2GB or 500MB, got {text!r}")
    unit = m.group(2).rstrip("B")
    scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(Fraction(m.group(1)) * scale)  # exact: float() made 400 digits inf, and int(inf) raised


# ---- config.json ----

def hf_config(cfg: ModelConfig, tokenizer=None, dtype: torch.dtype = torch.float32):
    """The transformers config object for cfg (see the module docstring for the architecture rule)."""
    import transformers  # deferred: a heavy import that only export needs

    special = {k: getattr(tokenizer, k, None) if tokenizer is not None else None
               for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    common = dict(vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tied, **special)
    if cfg.is_moe:
        return _moe_hf_config(cfg, common, dtype)
    if cfg.family == "gpt2":
        if cfg.kv_heads != cfg.n_heads:
            raise ConfigError(f"export: gpt2 has no grouped-query attention, got model.n_kv_heads={cfg.kv_heads} "
                              f"with n_heads={cfg.n_heads}; GPT2LMHeadModel cannot hold this model")
        out = transformers.GPT2Config(n_embd=cfg.d_model, n_layer=cfg.n_layers, n_head=cfg.n_heads,
                                      n_positions=cfg.max_seq_len, n_inner=cfg.ffn, activation_function="gelu_new",
                                      layer_norm_epsilon=cfg.norm_eps, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, **common)
        out.architectures = ["GPT2LMHeadModel"]
    else:
        if cfg.has_qk_norm:
            raise ConfigError(f"export: a dense {cfg.family} model with q/k norms has no Hugging Face class here "
                              "(Llama, Qwen2 and Mistral hold none: they would load without them), got "
                              "model.qk_norm=true; train without model.qk_norm, or use family qwen3_moe")
        attrs = dict(hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                     num_key_value_heads=cfg.kv_heads, intermediate_size=cfg.ffn,
                     max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
                     rope_theta=cfg.rope_theta, head_dim=cfg.head_dim, **common)
        window = cfg.sliding_window
        if cfg.has_qkv_bias:  # Qwen2 is llama plus q/k/v biases; max_window_layers=0: every layer slides
            # (Qwen2Config has no head_dim argument: it is kept as an attribute, which Qwen2Attention reads)
            out = transformers.Qwen2Config(use_sliding_window=window is not None, sliding_window=window,
                                           max_window_layers=0, **attrs)
            out.architectures = ["Qwen2ForCausalLM"]
        elif window is not None or cfg.family == "mistral":
            out = transformers.MistralConfig(sliding_window=window, **attrs)
            out.architectures = ["MistralForCausalLM"]
        else:
            out = transformers.LlamaConfig(attention_bias=False, mlp_bias=False, **attrs)
            out.architectures = ["LlamaForCausalLM"]
    out.dtype = str(dtype).removeprefix("torch.")
    return out


def _moe_hf_config(cfg: ModelConfig, common: dict, dtype: torch.dtype):
    """MixtralConfig / Qwen3MoeConfig for a mixture of experts; what neither class holds is refused."""
    import transformers  # deferred: a heavy import that only export needs

    wants = {"mixtral": (True, False, cfg.norm_topk), "qwen3_moe": (True, True, None)}
    fix = "export supports the mixtral and qwen3_moe layouts of transformers"
    if cfg.family not in wants:
        raise ConfigError(f"export: model.num_experts={cfg.num_experts} with family {cfg.family} has no Hugging Face "
                          f"class, got family {cfg.family}; use family mixtral or qwen3_moe ({fix})")
    if cfg.shared_expert_intermediate_size or cfg.has_qkv_bias or cfg.has_qk_norm != (cfg.family == "qwen3_moe"):
        raise ConfigError(f"export: {cfg.family} has no shared expert, no q/k/v bias and "
                          f"{'q/k norms' if cfg.family == 'qwen3_moe' else 'no q/k norms'}, got "
                          f"shared_expert_intermediate_size={cfg.shared_expert_intermediate_size}, "
                          f"qkv_bias={cfg.has_qkv_bias}, qk_norm={cfg.has_qk_norm}; {fix}")
    if cfg.family == "mixtral" and not cfg.norm_topk:
        raise ConfigError("export: mixtral always renormalises its top-k weights, got model.norm_topk_prob=false; "
                          "use family qwen3_moe or norm_topk_prob=true")
    attrs = dict(hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                 num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
                 hidden_act="silu", head_dim=cfg.head_dim, num_experts_per_tok=cfg.num_experts_per_tok,
                 rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                 router_aux_loss_coef=cfg.router_aux_loss_coef, **common)
    if cfg.family == "mixtral":
        out = transformers.MixtralConfig(intermediate_size=cfg.expert_ffn, num_local_experts=cfg.num_experts,
                                         sliding_window=cfg.sliding_window, router_jitter_noise=0.0, **attrs)
    else:
        if cfg.sliding_window:
            raise ConfigError(f"export: qwen3_moe is exported without a sliding window, got "
                              f"model.sliding_window={cfg.sliding_window}; drop it or use family mixtral")
        out = transformers.Qwen3MoeConfig(intermediate_size=cfg.ffn, moe_intermediate_size=cfg.expert_ffn,
                                          num_experts=cfg.num_experts, norm_topk_prob=cfg.norm_topk,
                                          decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False, **attrs)
    out.architectures = [FAMILY_CLASS[cfg.family]]
    out.dtype = str(dtype).removeprefix("torch.")
    return out


# ---- streaming safetensors writer ----

class ShardedSafetensorsWriter:
    """Writes tensors known in advance (name -> shape) into size-capped safetensors files, in any order.

    Headers are written first (their offsets follow from the shapes); write() puts one tensor's bytes
    at its offset. close() checks every tensor arrived and writes the index when there are shards."""

    def __init__(self, out_dir: str, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype, max_shard_bytes: int):
        if dtype not in SAFETENSORS_DTYPES:
            raise ConfigError(f"export: dtype must be one of {', '.join(map(str, SAFETENSORS_DTYPES))}, got {dtype}")
        self.out_dir, self.dtype, self.shapes = out_dir, dtype, dict(shapes)
        itemsize = torch.empty((), dtype=dtype).element_size()
        shards: list[list[str]] = [[]]
        sizes = [0]
        for name, shape in self.shapes.items():
            nbytes = itemsize * _numel(shape)
            if shards[-1] and sizes[-1] + nbytes > max_shard_bytes:  # a tensor above the cap gets its own file
                shards.append([])
                sizes.append(0)
            shards[-1].append(name)
            sizes[-1] += nbytes
        n = len(shards)
        self.filenames = [WEIGHTS_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.total_bytes = sum(sizes)
        self.where: dict[str, tuple[int, int, int]] = {}  # name -> (file index, absolute offset, nbytes)
        self.files = []
        for i, names in enumerate(shards):
            header: dict = {"__metadata__": {"format": "pt"}}
            offset = 0
            for name in names:
                nbytes = itemsize * _numel(self.shapes[name])
                header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(self.shapes[name]),
                                "data_offsets": [offset, offset + nbytes]}
                offset += nbytes
            blob = json.dumps(header, separators=(",", ":")).encode()
            blob += b" " * (-len(blob) % 8)  # the format pads the header to 8-byte alignment
            start = 8 + len(blob)
            for name in names:
                lo = header[name]["data_offsets"][0]
                self.where[name] = (i, start + lo, header[name]["data_offsets"][1] - lo)
            f = open(os.path.join(out_dir, self.filenames[i]), "wb")
            f.write(len(blob).to_bytes(8, "little") + blob)
            f.truncate(start + offset)
            self.files.append(f)
        self.written: set[str] = set()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        assert name in self.where and name not in self.written, f"export: unexpected or repeated tensor {name}"
        assert tuple(tensor.shape) == self.shapes[name], f"export: {name} shape {tuple(tensor.shape)}"
        index, offset, nbytes = self.where[name]
        data = tensor.detach().to(device="cpu", dtype=self.dtype).contiguous().reshape(-1).view(torch.uint8)
        assert data.numel() == nbytes, f"export: {name} has {data.numel()} bytes, header says {nbytes}"
        self.files[index].seek(offset)
        self.files[index].write(memoryview(data.numpy()))
        self.written.add(name)

    def _close_files(self) -> None:
        for f in self.files:
            f.close()

    def abort(self) -> None:
        """After a failed write: close and remove the files made so far, so no zero-filled model that loads is
        left in the folder."""
        self._close_files()
        for name in self.filenames[:len(self.files)]:
            path = os.path.join(self.out_dir, name)
            if os.path.exists(path):
                os.remove(path)

    def close(self) -> None:
        self._close_files()
        missing = [n for n in self.shapes if n not in self.written]
        if missing:
            raise ConfigError(f"export: {len(missing)} tensors never arrived, got none for {missing[:3]}; "
                              "the state is missing model weights")
        if len(self.filenames) > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {name: self.filenames[i] for name, (i, _, _) in self.where.items()}}
            with open(os.path.join(self.out_dir, INDEX_FILE), "w") as f:
                json.dump(index, f, indent=2)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---- export ----

# beside *.safetensors: what a model folder holds (generation_config.json too: export writes it, and one left in
# OUT, or a link of that name, was written through)
MODEL_FILES = (CONFIG_FILE, INDEX_FILE, GENERATION_CONFIG_FILE, "pipetrain_model.json")


def prepare_out_dir(out_dir: str, where: str, source_dir: str = "", overwrite: bool = False,
                    tokenizer_dir: str = "") -> None:
    """Create out_dir for a model's files. Refused: an existing file, a folder inside source_dir (or it), a
    pipetrain checkpoint (a folder holding manifest.json: never overwritten), the tokenizer folder being copied
    from, and (unless overwrite) a folder that already holds model files, or tokenizer files where tokenizer_dir
    will be copied in; with overwrite, the old ones go first so no stale shard or index is left beside the new."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"{where}: OUT {out_dir} is an existing file, got a file where a folder goes; "
                          "name a new folder")
    out = os.path.realpath(out_dir)
    for inside, what in ((source_dir, "the checkpoint"), (tokenizer_dir, "the tokenizer folder")):
        src = os.path.realpath(inside) if inside else None
        if src and (out == src or out.startswith(src + os.sep)):
            raise ConfigError(f"{where}: OUT {out_dir} is inside {what} {inside}; write outside it")
    if os.path.isfile(os.path.join(out_dir, "manifest.json")):
        raise ConfigError(f"{where}: OUT {out_dir} is a pipetrain checkpoint (it holds manifest.json), which is never "
                          "overwritten; write into a new folder")
    ours = MODEL_FILES + (TOKENIZER_FILES if tokenizer_dir else ())
    held = [f for f in os.listdir(out_dir) if f in ours or f.endswith(".safetensors")] \
        if os.path.isdir(out_dir) else []
    if held and not overwrite:
        raise ConfigError(f"{where}: {out_dir} already holds a model, got {sorted(held)[:5]}; "
                          "write into a new folder" + (" or pass --overwrite" if source_dir else ""))
    try:
        for f in held:
            os.remove(os.path.join(out_dir, f))
        os.makedirs(out_dir, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{where}: OUT {out_dir} cannot be written ({exc.strerror or exc}); name a folder you "
                          "can write") from None


def copy_tokenizer(tokenizer_dir: str, out_dir: str) -> list[str]:
    """Copy the tokenizer files transformers reads; ConfigError when tokenizer_dir holds none."""
    present = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(tokenizer_dir, f))]
    if not present:
        raise ConfigError(f"export: tokenizer directory {tokenizer_dir} has no tokenizer files, got "
                          f"{sorted(os.listdir(tokenizer_dir)) if os.path.isdir(tokenizer_dir) else 'no directory'}; "
                          "pass --tokenizer with a folder holding tokenizer.json")
    for f in present:
        shutil.copyfile(os.path.join(tokenizer_dir, f), os.path.join(out_dir, f))
    return present


def source_dtype(cfg: ModelConfig) -> torch.dtype:
    """The dtype of model.init_from's weights (config.json dtype / torch_dtype), fp32 without one."""
    if not cfg.init_from or not os.path.isdir(cfg.init_from):
        return torch.float32
    raw = read_hf_config(cfg.init_from)
    return HF_DTYPES.get(raw.get("dtype") or raw.get("torch_dtype"), torch.float32)


def write_generation_config(out_dir: str, source_dir: str | None, tokenizer) -> list[str]:
    """generation_config.json: copied from source_dir (model.init_from) when it has one, else written from
    the tokenizer's bos / eos / pad ids (pad falls back to eos, as generate() does). [] without either."""
    path = os.path.join(out_dir, GENERATION_CONFIG_FILE)
    if source_dir and os.path.isfile(os.path.join(source_dir, GENERATION_CONFIG_FILE)):
        shutil.copyfile(os.path.join(source_dir, GENERATION_CONFIG_FILE), path)
        return [GENERATION_CONFIG_FILE]
    if tokenizer is None or getattr(tokenizer, "eos_token_id", None) is None:
        return []
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id}
    with open(path, "w") as f:
        json.dump({k: v for k, v in ids.items() if v is not None}, f, indent=2)
    return [GENERATION_CONFIG_FILE]


def export_state(full_state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], model_cfg: ModelConfig,
                 out_dir: str, tokenizer_dir: str | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 dtype: torch.dtype | None = None) -> list[str]:
    """Write an HF model directory from full (unsharded) tensors keyed by our global names.

    full_state is a dict or an iterator of (name, tensor) in any order; tensors are consumed one at a
    time. head.weight is skipped when the embedding is tied. dtype None: source_dtype(model_cfg).
    Also writes generation_config.json (write_generation_config). Returns the files written."""
    dtype = dtype or source_dtype(model_cfg)
    tokenizer = None
    if tokenizer_dir:
        tokenizer = load_hf_tokenizer(tokenizer_dir, model_cfg)
    config = hf_config(model_cfg, tokenizer, dtype)  # fails before any file is written
    sources, shapes = hf_sources(model_cfg), hf_shapes(model_cfg)
    ours = {name: shape for name, (shape, _) in param_layout(_meta_model(model_cfg)).items()}
    parts = {}  # hf name -> number of our tensors fused into it
    for src in sources.values():
        parts[src.hf_name] = parts.get(src.hf_name, 0) + 1
    if model_cfg.tied:
        parts[sources["embed.weight"].hf_name] -= 1  # head.weight aliases the embedding
    prepare_out_dir(out_dir, "export", tokenizer_dir=tokenizer_dir or "")
    writer = ShardedSafetensorsWriter(out_dir, shapes, dtype, max_shard_bytes)
    pending: dict[str, dict[int, torch.Tensor]] = {}
    try:
        items = full_state.items() if isinstance(full_state, Mapping) else full_state
        for name, tensor in items:
            if model_cfg.tied and name == "head.weight":
                continue
            if name not in sources:
                raise ConfigError(f"export: tensor {name} is not a parameter of this {model_cfg.family} model, got "
                                  f"shape {tuple(tensor.shape)}; pass only model weights by global name")
            if tuple(tensor.shape) != ours[name]:
                raise ConfigError(f"export: tensor {name} must have shape {ours[name]} for this model config, "
                                  f"got {tuple(tensor.shape)}; pass full (unsharded) tensors")
            src = sources[name]
            if parts[src.hf_name] > 1:  # a fused tensor: wait for all its parts
                pending.setdefault(src.hf_name, {})[src.offset] = tensor.detach()
                if len(pending[src.hf_name]) < parts[src.hf_name]:
                    continue
                got = pending.pop(src.hf_name)
                tensor = torch.cat([got[k] for k in sorted(got)], dim=src.dim)
            writer.write(src.hf_name, tensor.t() if src.transpose else tensor)
            del tensor
    except BaseException:
        writer.abort()
        raise
    writer.close()
    written = list(writer.filenames) + ([INDEX_FILE] if len(writer.filenames) > 1 else [])
    if tokenizer_dir:
        written += copy_tokenizer(tokenizer_dir, out_dir)
    written += write_generation_config(out_dir, model_cfg.init_from, tokenizer)
    config.to_json_file(os.path.join(out_dir, CONFIG_FILE))
    return written + [CONFIG_FILE]


def _meta_model(cfg: ModelConfig) -> nn.Module:
    return build(cfg, device="meta")


def refuse_expert_bias(buffers: Iterable[tuple[str, torch.Tensor]]) -> None:
    """The aux-loss-free router bias (model.router_bias_update_rate) changes which experts a token goes to,
    and no mixtral / qwen3_moe class of transformers holds it: an export without it would route differently
    and give other logits, so a trained (nonzero) bias is refused rather than dropped."""
    for name, bias in buffers:
        if name.endswith("expert_bias") and bool(bias.ne(0).any()):
            raise ConfigError(f"export: {name} is nonzero (trained with model.router_bias_update_rate), got max "
                              f"|bias| {float(bias.abs().max()):.3g}; transformers' mixtral / qwen3_moe route "
                              "without it, so train with model.router_bias_update_rate=0 to export")


def export_model(model: nn.Module, cfg: ModelConfig, out_dir: str, tokenizer_dir: str | None = None,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, dtype: torch.dtype | None = None) -> list[str]:
    """Export a whole single-process model (not tensor-parallel, not pipeline-pruned) held in memory."""
    refuse_expert_bias(model.named_buffers())
    params = dict(model.named_parameters(remove_duplicate=False))
    layout = param_layout(model)
    for name, (shape, _) in layout.items():
        if tuple(params[name].shape) != shape:
            raise ValueError(f"export_model: {name} is a tensor-parallel shard {tuple(params[name].shape)} of "
                             f"{shape}; export from a checkpoint (python -m pipetrain.hf export) instead")
    return export_state(((n, params[n]) for n in layout), cfg, out_dir, tokenizer_dir, max_shard_bytes, dtype)


def lora_checkpoint_model(ckpt_dir: str, manifest: dict) -> nn.Module:
    """The whole single-process model of an adapter-only (LoRA) checkpoint: its base (model.init_from,
    checked against the recorded SHA-256, or the seeded initialisation) with the saved adapters."""
    cfg, seed = checkpoint_model_config(manifest), manifest["recipe"]["train"]["seed"]
    check_base(manifest, cfg.init_from, seed, ckpt_dir)
    model = build(cfg, device="meta")
    if cfg.init_from:
        load_hf_weights(model, cfg.init_from, cfg)
    else:
        materialize(model, cfg, seed, "cpu")
    apply_lora(model, cfg, ParallelDims(), seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in iter_full_tensors(ckpt_dir, names={n for n in params if is_adapter(n)}):
            params[name].copy_(tensor)
    return model


def export_checkpoint(ckpt_dir: str, out_dir: str, tokenizer_dir: str | None = None,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, dtype: torch.dtype | None = None) -> list[str]:
    """Export a pipetrain checkpoint (any layout) through pipetrain.checkpoint's full-tensor reader; a
    LoRA checkpoint merged into its base. dtype None: the source dtype (source_dtype)."""
    manifest = read_manifest(ckpt_dir)
    verify_files(ckpt_dir, manifest)  # sizes and SHA-256 of every file, before anything is written
    recipe = manifest["recipe"]
    model_cfg = checkpoint_model_config(manifest)
    given = tokenizer_dir is not None
    if not given:
        tokenizer_dir = recipe.get("data", {}).get("tokenizer") or model_cfg.init_from
    if tokenizer_dir and not os.path.isdir(tokenizer_dir):
        where = "--tokenizer" if given else f"the tokenizer directory recorded in {ckpt_dir}'s recipe"
        raise ConfigError(f"export: {where} was not found, got {tokenizer_dir!r}; pass --tokenizer DIR, a folder "
                          "with tokenizer.json")
    if "base" in manifest:  # LoRA: adapters only; merge them into the base in memory
        model = merge_lora(lora_checkpoint_model(ckpt_dir, manifest))
        base_cfg = dataclasses.replace(model_cfg, lora_rank=None, lora_targets=[])
        return export_model(model, base_cfg, out_dir, tokenizer_dir, max_shard_bytes, dtype)
    reader = TensorReader(ckpt_dir, manifest)
    refuse_expert_bias((n, reader.read(n, [0] * len(t["global_shape"]), t["global_shape"]))
                       for n, t in manifest["tensors"].items() if n.startswith("buffer/"))
    names = set(hf_sources(model_cfg))  # model weights only: optimizer moments are never read
    stream: Iterator = iter_full_tensors(ckpt_dir, names=names)
    return export_state(stream, model_cfg, out_dir, tokenizer_dir, max_shard_bytes, dtype)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m pipetrain.hf", description="Hugging Face export.")
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export", help="write a transformers model directory from a pipetrain checkpoint")
    exp.add_argument("ckpt_dir", help="a checkpoint directory (manifest.json + *.safetensors)")
    exp.add_argument("out_dir", help="a new directory for config.json, weights and tokenizer")
    exp.add_argument("--max-shard-size", default="2GB", help="split weight files above this size (default 2GB)")
    exp.add_argument("--dtype", choices=sorted(CLI_DTYPES), default=None,
                     help="weight dtype (default: the source model's, fp32 for a model trained from scratch)")
    exp.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the one in the recipe)")
    exp.add_argument("--peft", action="store_true",
                     help="a LoRA checkpoint's adapters only, as a PEFT adapter folder (PeftModel.from_pretrained)")
    args = parser.parse_args(argv)
    dtype = CLI_DTYPES[args.dtype] if args.dtype else None
    try:
        if args.peft:
            files = export_peft(args.ckpt_dir, args.out_dir, dtype)
        else:
            files = export_checkpoint(args.ckpt_dir, args.out_dir, args.tokenizer, parse_size(args.max_shard_size),
                                      dtype)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out_dir}: {', '.join(files)}")
    return 0
