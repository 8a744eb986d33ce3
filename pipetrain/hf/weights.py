"""Hugging Face safetensors weights -> any (tp, pp) layout, reading only each rank's slices.

load_hf_weights(model, hf_dir, cfg) fills every parameter the model holds (possibly tensor-parallel
and pipeline-pruned) from model.safetensors or a sharded model.safetensors.index.json. Each rank
reads only its own slices with safe_open(...).get_slice(name)[slices], from the (global shape, local
slices) that pipetrain.models.init.param_layout reports. Name mapping (hf_sources):
  llama/qwen2/mistral: model.embed_tokens -> embed, model.layers.N.self_attn.{q,k,v,o}_proj ->
    layers.N.attn.{wq,wk,wv,wo}, mlp.{gate,up,down}_proj -> mlp.{gate,up,down}, input_layernorm ->
    attn_norm, post_attention_layernorm -> mlp_norm, model.norm -> norm, lm_head -> head.
  mixtral/qwen3_moe: as llama, plus self_attn.{q,k}_norm -> attn.{q,k}_norm (qwen3_moe), mlp.gate ->
    mlp.router, and the experts fused as transformers 5 stores them (mlp.experts.gate_up_proj (E, 2F, D):
    gate rows then up rows -> mlp.experts.gate / up; down_proj -> down) or, when the fused tensor is
    absent, transformers 4.x's per-expert modules (block_sparse_moe.experts.{i}.w1/w3/w2 for mixtral,
    mlp.experts.{i}.{gate,up,down}_proj for qwen3_moe) stacked into our (E, ...) tensors.
  gpt2: transformer.wte/wpe -> embed/pos_embed, h.N.ln_1/ln_2 -> attn_norm/mlp_norm, h.N.attn.c_attn
    (fused q|k|v) -> wq, wk, wv, attn.c_proj -> wo, mlp.c_fc/c_proj -> up/down, ln_f -> norm.
    GPT-2's Conv1D stores weights as (in, out), the transpose of nn.Linear; a local slice of ours is
    read as the transposed slice of the HF tensor (plus the q/k/v offset inside c_attn), so even the
    fused matrix is never read whole.
RoPE needs no permutation: HF checkpoints use the rotate_half layout, which pipetrain's rope kernel
also uses (the tests check logits against transformers). Tied embeddings: head.weight (including a
pipeline's last-stage copy) is read from the embedding tensor, the tensor transformers ties it to.

May import: config, folders, jsonfile, models. Never: parallel, trainer, build, cli.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open

from pipetrain.config import ConfigError, ModelConfig, clip
from pipetrain.folders import refuse_folder_links_outside
from pipetrain.jsonfile import read_json
from pipetrain.models import build, param_layout

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
INDEX_MAX_BYTES = 256 << 20  # a weight index names each tensor once: a few MB even for the largest models


@dataclass(frozen=True)
class HFSource:
    """Where one of our global tensors lives in an HF checkpoint.

    Our tensor is rows [offset, offset + rows) along `dim` of the HF tensor, after transposing it
    when `transpose` (GPT-2 Conv1D stores (in, out)); rows=None means the whole tensor. experts > 0:
    hf_name holds "{e}" and our tensor stacks the E tensors it names along a new dim 0 (transformers
    4.x's per-expert modules; the fused tensors of transformers 5 are one (E, ...) tensor)."""
    hf_name: str
    transpose: bool = False
    offset: int = 0
    rows: int | None = None
    dim: int = 0
    experts: int = 0


# The experts' layouts, by family: fused (transformers 5: gate|up in one (E, 2F, D) tensor) and per expert
# (transformers 4.x modules). Our gate/up/down -> (HF name under the layer, rows part of gate_up or None).
MOE_BLOCK = {"mixtral": "block_sparse_moe", "qwen3_moe": "mlp"}  # 4.x module name (5 renames mixtral's to mlp)
PER_EXPERT = {"mixtral": {"gate": "w1", "up": "w3", "down": "w2"},
              "qwen3_moe": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}}


def _expert_sources(cfg: ModelConfig, h: str, me: str, per_expert: bool) -> dict[str, HFSource]:
    """The router and experts of one layer: fused (transformers 5) or per-expert (4.x) names."""
    E, Fe = cfg.num_experts, cfg.expert_ffn
    if per_expert:
        block = f"{h}.{MOE_BLOCK[cfg.family]}"
        names = PER_EXPERT[cfg.family]
        out = {f"{me}.mlp.experts.{ours}": HFSource(f"{block}.experts.{{e}}.{names[ours]}.weight", experts=E)
               for ours in ("gate", "up", "down")}
        out[f"{me}.mlp.router.weight"] = HFSource(f"{block}.gate.weight")
        return out
    return {f"{me}.mlp.router.weight": HFSource(f"{h}.mlp.gate.weight"),
            f"{me}.mlp.experts.gate": HFSource(f"{h}.mlp.experts.gate_up_proj", offset=0, rows=Fe, dim=1),
            f"{me}.mlp.experts.up": HFSource(f"{h}.mlp.experts.gate_up_proj", offset=Fe, rows=Fe, dim=1),
            f"{me}.mlp.experts.down": HFSource(f"{h}.mlp.experts.down_proj")}


def hf_sources(cfg: ModelConfig, per_expert: bool = False) -> dict[str, HFSource]:
    """{our global parameter name: HFSource} for every parameter of the full model cfg describes.
    per_expert: a mixture of experts in transformers 4.x's per-expert layout (else 5's fused tensors)."""
    out: dict[str, HFSource] = {}
    if cfg.family == "gpt2":
        d, kv = cfg.d_model, cfg.kv_heads * cfg.head_dim
        out["embed.weight"] = HFSource("transformer.wte.weight")
        out["pos_embed.weight"] = HFSource("transformer.wpe.weight")
        for i in range(cfg.n_layers):
            h, me = f"transformer.h.{i}", f"layers.{i}"
            for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
                for leaf in ("weight", "bias"):
                    out[f"{me}.{ours}.{leaf}"] = HFSource(f"{h}.{theirs}.{leaf}")
            for proj, offset, rows in (("wq", 0, d), ("wk", d, kv), ("wv", d + kv, kv)):
                out[f"{me}.attn.{proj}.weight"] = HFSource(f"{h}.attn.c_attn.weight", True, offset, rows)
                out[f"{me}.attn.{proj}.bias"] = HFSource(f"{h}.attn.c_attn.bias", False, offset, rows)
            for ours, theirs in (("attn.wo", "attn.c_proj"), ("mlp.up", "mlp.c_fc"), ("mlp.down", "mlp.c_proj")):
                out[f"{me}.{ours}.weight"] = HFSource(f"{h}.{theirs}.weight", True)
                out[f"{me}.{ours}.bias"] = HFSource(f"{h}.{theirs}.bias")
        out["norm.weight"] = HFSource("transformer.ln_f.weight")
        out["norm.bias"] = HFSource("transformer.ln_f.bias")
    else:
        out["embed.weight"] = HFSource("model.embed_tokens.weight")
        for i in range(cfg.n_layers):
            h, me = f"model.layers.{i}", f"layers.{i}"
            out[f"{me}.attn_norm.weight"] = HFSource(f"{h}.input_layernorm.weight")
            out[f"{me}.mlp_norm.weight"] = HFSource(f"{h}.post_attention_layernorm.weight")
            for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
                out[f"{me}.attn.{ours}.weight"] = HFSource(f"{h}.self_attn.{theirs}.weight")
                if cfg.has_qkv_bias and ours != "wo":
                    out[f"{me}.attn.{ours}.bias"] = HFSource(f"{h}.self_attn.{theirs}.bias")
            if cfg.has_qk_norm:
                for ours in ("q_norm", "k_norm"):
                    out[f"{me}.attn.{ours}.weight"] = HFSource(f"{h}.self_attn.{ours}.weight")
            if cfg.is_moe:
                out.update(_expert_sources(cfg, h, me, per_expert))
                continue
            for ours in ("gate", "up", "down"):
                out[f"{me}.mlp.{ours}.weight"] = HFSource(f"{h}.mlp.{ours}_proj.weight")
        out["norm.weight"] = HFSource("model.norm.weight")
    out["head.weight"] = out["embed.weight"] if cfg.tied else HFSource("lm_head.weight")
    return out


def hf_shapes(cfg: ModelConfig, per_expert: bool = False) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: shape} of the checkpoint cfg describes (fused tensors included once)."""
    layout = param_layout(build(cfg, device="meta"))
    sources = hf_sources(cfg, per_expert)
    transposed = {src.hf_name for src in sources.values() if src.transpose}
    fused: dict[str, list] = {}
    for name, src in sources.items():
        if name not in layout:  # head.weight of a tied model: param_layout lists the shared tensor once
            continue
        shape = list(layout[name][0])
        if src.experts:  # one HF tensor per expert
            for e in range(src.experts):
                fused[src.hf_name.format(e=e)] = shape[1:]
        elif src.rows is not None:  # one part of a fused tensor: sum the parts along src.dim
            acc = fused.setdefault(src.hf_name, shape[:src.dim] + [0] + shape[src.dim + 1:])
            acc[src.dim] += shape[src.dim]
        else:
            fused[src.hf_name] = shape
    return {name: tuple(shape[::-1]) if name in transposed else tuple(shape) for name, shape in fused.items()}


def _inside_name(index: str, name) -> str:
    """A weight_map file name, checked as text: relative and without a `..` component, so an index can
    never make a load read a file outside its model folder. (Links inside the folder, as in a Hugging
    Face cache snapshot whose files link into its blobs folder, are the folder's own and still load.)"""
    if not isinstance(name, str) or not name or os.path.isabs(name) or name.startswith(("/", "\\")) \
            or ".." in name.replace("\\", "/").split("/") or "\0" in name:
        raise ConfigError(f"model.init_from: {index} names weight file {clip(repr(name))}, which is not a plain "
                          "name inside the model folder; the index may only list files in its own folder")
    return name


class HFWeights:
    """Read-only view of an HF model's safetensors files (single file or sharded index).

    Each read opens its file anew: safe_open memory-maps the whole file and every page a read
    touches stays in this process's RSS while the map is open, so one long-lived handle would
    hold a second copy of the model until the end of loading."""

    def __init__(self, hf_dir: str):
        self.hf_dir = hf_dir
        refuse_folder_links_outside(hf_dir, "model.init_from")
        index = os.path.join(hf_dir, INDEX_FILE)
        single = os.path.join(hf_dir, WEIGHTS_FILE)
        if os.path.isfile(index):
            raw = read_json(index, "model.init_from", ConfigError, "re-save the model", INDEX_MAX_BYTES)
            try:
                weight_map = dict(raw["weight_map"])
            except (ValueError, KeyError, AttributeError, TypeError) as exc:
                raise ConfigError(f"model.init_from: {index} has no readable weight_map, got {clip(repr(exc))}; "
                                  "re-save the model") from None
            self.files = {k: os.path.join(hf_dir, _inside_name(index, v)) for k, v in weight_map.items()}
        elif os.path.isfile(single):
            self.files = None  # filled lazily from the single file's keys
        else:
            present = sorted(f for f in os.listdir(hf_dir) if f.endswith((".bin", ".pt", ".pth", ".safetensors")))
            raise ConfigError(f"model.init_from: {hf_dir} has neither {WEIGHTS_FILE} nor {INDEX_FILE}, got "
                              f"weight files {present}; save the model with safe_serialization (safetensors)")
        self._single = single

    @staticmethod
    def _open(path: str):
        if not os.path.isfile(path):
            raise ConfigError(f"model.init_from: weight file {path} listed in {INDEX_FILE} not found; "
                              "copy every shard of the model")
        try:
            return safe_open(path, framework="pt")
        except (SafetensorError, OSError) as exc:  # a truncated file, a header length past the file, bad JSON
            raise ConfigError(f"model.init_from: {path} is not a readable safetensors file ({clip(exc)}); "
                              "re-save or re-download the model") from None

    def file_of(self, name: str) -> str:
        if self.files is None:
            with self._open(self._single) as f:
                self.files = {k: self._single for k in f.keys()}
        for candidate in (name, name.partition(".")[2]):  # also accept base-model names (no "model.")
            if candidate in self.files:
                return candidate
        where = os.path.join(self.hf_dir, INDEX_FILE if os.path.isfile(
            os.path.join(self.hf_dir, INDEX_FILE)) else WEIGHTS_FILE)
        raise ConfigError(f"model.init_from: tensor {name} is missing from {where}; the checkpoint does not "
                          "match its config.json")

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds a tensor of this name (or its base-model name)."""
        if self.files is None:
            with self._open(self._single) as f:
                self.files = {k: self._single for k in f.keys()}
        return name in self.files or name.partition(".")[2] in self.files

    def refuse_layers_past(self, n_layers: int) -> None:
        """ConfigError when the weights hold a layer config.json does not have (num_hidden_layers below the
        weights' count loaded the first layers and dropped the rest without a word)."""
        self.has("")  # lists the single file's names
        layers = {int(m.group(1)) for m in map(_LAYER_INDEX.search, self.files) if m}
        past = sorted(i for i in layers if i >= n_layers)
        if past:
            raise ConfigError(f"model.init_from: {self.hf_dir}'s weights hold layer {past[0]} (of {past[-1] + 1}), "
                              f"but config.json gives {n_layers} layers; the weights do not match the config: use "
                              "the config.json saved with them")

    def read(self, src: HFSource, slices: tuple[slice, ...], shapes: dict[str, tuple[int, ...]]) -> torch.Tensor:
        """The local slice of our tensor, read from the HF tensor(s) without loading the rest of them;
        shapes: hf_shapes of the config, every HF tensor's expected shape."""
        if src.experts:  # our (E, ...) tensor stacks one HF tensor per expert: read this rank's experts
            rows = range(src.experts)[slices[0]]
            one = dataclasses.replace(src, experts=0)
            return torch.stack([self.read(dataclasses.replace(one, hf_name=src.hf_name.format(e=e)), slices[1:],
                                          shapes) for e in rows])
        expected_shape = shapes[src.hf_name]
        key = self.file_of(src.hf_name)
        path = self.files[key]
        slices = list(slices)
        if src.rows is not None:  # shift our slice along src.dim to the part's rows inside the fused tensor
            s = slices[src.dim]
            start, stop = s.start or 0, src.rows if s.stop is None else s.stop
            slices[src.dim] = slice(src.offset + start, src.offset + stop)
        with self._open(path) as f:
            view = f.get_slice(key)
            shape = tuple(view.get_shape())
            if shape != tuple(expected_shape):
                raise ConfigError(f"model.init_from: tensor {key} in {path} must have shape "
                                  f"{tuple(expected_shape)} (from config.json), got {shape}; the weights do "
                                  "not match the config")
            if view.get_dtype() not in WEIGHT_DTYPES:  # an int, bool, complex or float8 tensor was cast silently
                raise ConfigError(f"model.init_from: tensor {key} in {path} is {view.get_dtype()}, where a model's "
                                  f"weights are one of {', '.join(WEIGHT_DTYPES)}; the weights are not this model's")
            part = view[tuple(slices[::-1])].t() if src.transpose else view[tuple(slices)]  # a copy
        return part


_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")  # model.layers.N. (llama family), transformer.h.N. (gpt2)

# safetensors' names of the dtypes a model's weights may be stored in (each casts exactly to the fp32 masters)
WEIGHT_DTYPES = ("F32", "F16", "BF16", "F64")


def _retie(model: nn.Module, cfg: ModelConfig) -> None:
    """to_empty() gives every module its own tensor; a tied embedding must be one parameter again."""
    embed, head = getattr(model, "embed", None), getattr(model, "head", None)
    if cfg.tied and embed is not None and head is not None and head.weight is not embed.weight:
        head.weight = embed.weight


@torch.no_grad()
def load_hf_weights(model: nn.Module, hf_dir: str, cfg: ModelConfig,
                    device: torch.device | str | None = None) -> nn.Module:
    """Fill every parameter model holds from the HF checkpoint in hf_dir, reading only local slices.

    model may be on meta (it is allocated on `device`, default cpu, like materialize) or already
    allocated; it may be tensor-parallel and/or pruned to a pipeline stage. Call it instead of
    materialize. Re-ties head.weight to embed.weight when cfg.tied and both live here."""
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device or "cpu")
    _retie(model, cfg)
    weights = HFWeights(hf_dir)
    weights.refuse_layers_past(cfg.n_layers)
    per_expert = cfg.is_moe and not weights.has(hf_sources(cfg)["layers.0.mlp.experts.down"].hf_name)
    sources, shapes = hf_sources(cfg, per_expert), hf_shapes(cfg, per_expert)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, (_, slices) in param_layout(model).items():
        assert name in sources, f"parameter {name} has no Hugging Face source for family {cfg.family}"
        piece = weights.read(sources[name], slices, shapes)
        if piece.is_floating_point() and not bool(torch.isfinite(piece).all()):  # else: "loss is nan" at step 1
            raise ConfigError(f"model.init_from: {hf_dir}: weight {sources[name].hf_name} holds NaN or inf values; "
                              "the model folder is damaged: use an intact copy of the model")
        params[name].copy_(piece)
    return model
