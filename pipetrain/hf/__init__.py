"""Hugging Face import: config.json -> ModelConfig, safetensors weights -> any (tp, pp) layout.

model_config_from_hf(hf_dir, recipe_model) reads config.json of a llama, qwen2, mistral or gpt2
model. Every option pipetrain cannot reproduce exactly (RoPE scaling, o_proj/MLP biases, other
activations, a head_dim other than d_model/n_heads, mixed sliding/full layers, ...) is a ConfigError
naming the option. A recipe model key is "set by the user" when it differs from ModelConfig()'s
default; such a key must agree with config.json (else a ConfigError names both values), and every
key left at its default is filled from config.json. (So a recipe that spells out a default value,
e.g. vocab_size: 8192, cannot be told apart from one that omits it; it is simply filled.)

load_hf_weights(model, hf_dir, cfg) fills every parameter the model holds (possibly tensor-parallel
and pipeline-pruned) from model.safetensors or a sharded model.safetensors.index.json. Each rank
reads only its own slices with safe_open(...).get_slice(name)[slices], from the (global shape, local
slices) that pipetrain.models.init.param_layout reports. Name mapping (hf_sources):
  llama/qwen2/mistral: model.embed_tokens -> embed, model.layers.N.self_attn.{q,k,v,o}_proj ->
    layers.N.attn.{wq,wk,wv,wo}, mlp.{gate,up,down}_proj -> mlp.{gate,up,down}, input_layernorm ->
    attn_norm, post_attention_layernorm -> mlp_norm, model.norm -> norm, lm_head -> head.
  gpt2: transformer.wte/wpe -> embed/pos_embed, h.N.ln_1/ln_2 -> attn_norm/mlp_norm, h.N.attn.c_attn
    (fused q|k|v) -> wq, wk, wv, attn.c_proj -> wo, mlp.c_fc/c_proj -> up/down, ln_f -> norm.
    GPT-2's Conv1D stores weights as (in, out), the transpose of nn.Linear; a local slice of ours is
    read as the transposed slice of the HF tensor (plus the q/k/v offset inside c_attn), so even the
    fused matrix is never read whole.
RoPE needs no permutation: HF checkpoints use the rotate_half layout, which pipetrain's rope kernel
also uses (the tests check logits against transformers). Tied embeddings: head.weight (including a
pipeline's last-stage copy) is read from the embedding tensor, the tensor transformers ties it to.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open

from pipetrain.config import ConfigError, ModelConfig, clip
from pipetrain.data import load_tokenizer
from pipetrain.models import build, param_layout

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
            "gpt2": "GPT2LMHeadModel"}
# Recipe keys that config.json defines; the rest (init_from, init_std) stay as the recipe has them.
HF_KEYS = ("family", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len",
           "tie_embeddings", "rope_theta", "norm_eps", "qkv_bias", "sliding_window")
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both are GELU's tanh approximation, as ours


# ---- config ----

def read_hf_config(hf_dir: str) -> dict:
    """config.json of a local HF model directory as a dict (ConfigError when absent or unreadable)."""
    path = os.path.join(hf_dir, CONFIG_FILE)
    if not os.path.isdir(hf_dir):
        raise ConfigError(f"model.init_from: directory not found, got {hf_dir!r}; point it at a local "
                          "Hugging Face model folder (config.json + model.safetensors)")
    if not os.path.isfile(path):
        raise ConfigError(f"model.init_from: {path} not found; the folder needs the model's config.json "
                          "(save_pretrained writes it)")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"model.init_from: {path} is not valid JSON, got {exc}; re-save the model") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"model.init_from: {path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def _family(raw: dict, path: str) -> str:
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    if not isinstance(model_type, (str, type(None))) or not isinstance(archs, list) \
            or not all(isinstance(a, str) for a in archs):
        raise ConfigError(f"{path}: model_type must be a string and architectures a list of class names, got "
                          f"{clip(repr(model_type))} and {clip(repr(archs))}; re-save the model")
    family = model_type if model_type in FAMILIES else next(
        (f for f, cls in FAMILIES.items() if model_type is None and cls in archs), None)
    if family is None:
        raise ConfigError(f"{path}: model_type must be one of {', '.join(FAMILIES)}, got {model_type!r} "
                          f"(architectures {archs}); pipetrain imports only these decoder families")
    if archs and FAMILIES[family] not in archs:
        raise ConfigError(f"{path}: architectures must include {FAMILIES[family]} (a causal LM with its head), "
                          f"got {archs}; export the model with its language-modelling head")
    return family


def _rope_theta(raw: dict, path: str, problems: list[str]) -> float:
    """rope_theta from transformers 5's rope_parameters or 4.x's rope_theta + rope_scaling."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = raw.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            problems.append(f"{path}: {key} must be an object, got {clip(repr(rope))}")
            continue
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            problems.append(f"{path}: {key}.rope_type must be 'default' (RoPE scaling is not implemented), "
                            f"got {kind!r}; use a model without rope scaling")
        factor = rope.get("partial_rotary_factor", 1.0)
        if factor != 1.0:
            problems.append(f"{path}: {key}.partial_rotary_factor must be 1.0, got {factor}")
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if not _positive_number(theta):
        problems.append(f"{path}: rope_theta must be a positive number, got {clip(repr(theta))}")
        return 10000.0
    return float(theta)


def _positive_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")


def _hf_values(raw: dict, family: str, path: str) -> dict:
    """The HF_KEYS values config.json defines; appends every unsupported option to one error."""
    problems: list[str] = []

    def need(cond: bool, option: str, got, fix: str):
        if not cond:
            problems.append(f"{path}: {option} is not supported, got {clip(repr(got))}; {fix}")

    def req(key: str, default=None):
        """A positive integer field (default when absent or null and a default is given)."""
        value = raw.get(key)
        if value is None and default is not None:
            return default
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"{path}: {key} must be a positive integer, got {clip(repr(value))}")
            return 1
        return value

    def num(key: str, default: float) -> float:
        """A positive finite number field (epsilons)."""
        value = raw.get(key, default)
        if not _positive_number(value):
            problems.append(f"{path}: {key} must be a positive number, got {clip(repr(value))}")
            return default
        return float(value)

    need(raw.get("quantization_config") is None, "quantization_config", raw.get("quantization_config"),
         "use unquantized (fp32/bf16/fp16) weights")
    if family == "gpt2":
        d, heads = req("n_embd"), req("n_head")
        act = raw.get("activation_function", "gelu_new")
        need(act in GPT2_ACTIVATIONS, "activation_function", act, f"use one of {', '.join(GPT2_ACTIVATIONS)}")
        need(raw.get("scale_attn_weights", True) is True, "scale_attn_weights=false",
             raw.get("scale_attn_weights"), "use 1/sqrt(head_dim) attention scaling")
        for flag in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
            need(not raw.get(flag, False), flag, raw.get(flag), "set it to false")
        out = dict(family=family, vocab_size=req("vocab_size"), d_model=d, n_layers=req("n_layer"),
                   n_heads=heads, n_kv_heads=heads, ffn_hidden=req("n_inner", 4 * d),
                   max_seq_len=req("n_positions"), tie_embeddings=bool(raw.get("tie_word_embeddings", True)),
                   norm_eps=num("layer_norm_epsilon", 1e-5))
    else:
        d, heads = req("hidden_size"), req("num_attention_heads")
        act = raw.get("hidden_act", "silu")
        need(act == "silu", "hidden_act", act, "pipetrain's gated MLP is SwiGLU (silu)")
        need(not raw.get("attention_bias", False), "attention_bias", raw.get("attention_bias"),
             "pipetrain's llama layers have no q/k/v/o biases (qwen2 has q/k/v biases only)")
        need(not raw.get("mlp_bias", False), "mlp_bias", raw.get("mlp_bias"), "use a model without MLP biases")
        head_dim = raw.get("head_dim")
        need(head_dim is None or (isinstance(head_dim, int) and head_dim == d // heads), "head_dim != hidden_size/num_attention_heads", head_dim,
             f"pipetrain derives head_dim={d // heads} from hidden_size={d} and num_attention_heads={heads}")
        window = None
        if family == "mistral" or (family == "qwen2" and raw.get("use_sliding_window")):
            window = req("sliding_window") if raw.get("sliding_window") is not None else None
        if family == "qwen2":
            n_layers, first_window = req("num_hidden_layers"), raw.get("max_window_layers", 0)
            types = raw.get("layer_types")
            if types is not None and not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
                problems.append(f"{path}: layer_types must be a list of strings, got {clip(repr(types))}")
                types = []
            if not isinstance(first_window, int) or isinstance(first_window, bool):
                problems.append(f"{path}: max_window_layers must be an integer, got {clip(repr(first_window))}")
                first_window = 0
            if not types:  # full below max_window_layers, sliding from it on: the ends tell whether both occur
                types = sorted({"sliding_attention" if window is not None and i >= first_window
                                else "full_attention" for i in (0, n_layers - 1)})
            need(len(set(types)) <= 1, "a mix of sliding and full attention layers (layer_types)",
                 sorted(set(types)), "use use_sliding_window=false or max_window_layers=0")
            window = window if types and types[0] == "sliding_attention" else None
        out = dict(family=family, vocab_size=req("vocab_size"), d_model=d, n_layers=req("num_hidden_layers"),
                   n_heads=heads, n_kv_heads=req("num_key_value_heads", heads),
                   ffn_hidden=req("intermediate_size"), max_seq_len=req("max_position_embeddings"),
                   tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
                   rope_theta=_rope_theta(raw, path, problems), norm_eps=num("rms_norm_eps", 1e-6),
                   qkv_bias=family == "qwen2", sliding_window=window)
    if not problems:
        need(out["d_model"] % out["n_heads"] == 0, "hidden size not divisible by the head count",
             (out["d_model"], out["n_heads"]), "pipetrain needs d_model % n_heads == 0")
        need(out["n_heads"] % out["n_kv_heads"] == 0, "heads not divisible by key/value heads",
             (out["n_heads"], out["n_kv_heads"]), "use a model whose kv heads divide its heads")
    if problems:
        raise ConfigError("; ".join(problems))
    return out


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(float(a), float(b), rel_tol=1e-9)
    return a == b


def model_config_from_hf(hf_dir: str, recipe_model: ModelConfig | None = None) -> ModelConfig:
    """The ModelConfig of a local HF model: config.json values, checked against the recipe's model keys.

    Keys the recipe left at their ModelConfig() defaults are filled from config.json; any other recipe
    value must agree with it. init_from is set to hf_dir; init_std is kept from the recipe."""
    recipe_model = recipe_model or ModelConfig()
    raw = read_hf_config(hf_dir)
    path = os.path.join(hf_dir, CONFIG_FILE)
    family = _family(raw, path)
    values = _hf_values(raw, family, path)
    defaults = ModelConfig()
    problems = []
    for key, hf_value in values.items():
        mine = getattr(recipe_model, key)
        if mine != getattr(defaults, key) and not _same(mine, hf_value):
            problems.append(f"model.{key}={mine!r} contradicts {path} ({key}={hf_value!r}); remove model.{key} "
                            "from the recipe (model.init_from defines it) or point init_from at another model")
    if problems:
        raise ConfigError("; ".join(problems))
    return dataclasses.replace(recipe_model, init_from=hf_dir, **values)


# ---- tokenizer ----

def check_tokenizer_vocab(tokenizer, cfg: ModelConfig, where: str = "data.tokenizer") -> None:
    """ConfigError when the tokenizer can emit ids the model has no embedding row for."""
    if len(tokenizer) > cfg.vocab_size:
        raise ConfigError(f"{where}: the tokenizer has {len(tokenizer)} tokens, more than the model's "
                          f"vocab_size={cfg.vocab_size}, got ids up to {len(tokenizer) - 1}; use the tokenizer "
                          "saved with the model (data.tokenizer empty reads it from model.init_from)")


def load_hf_tokenizer(path: str, cfg: ModelConfig):
    """The tokenizer at path (usually model.init_from), checked against cfg.vocab_size."""
    tokenizer = load_tokenizer(path)
    check_tokenizer_vocab(tokenizer, cfg)
    return tokenizer


# ---- weights ----

@dataclass(frozen=True)
class HFSource:
    """Where one of our global tensors lives in an HF checkpoint.

    Our tensor is rows [offset, offset + rows) along dim 0 of the HF tensor, after transposing it
    when `transpose` (GPT-2 Conv1D stores (in, out)); rows=None means the whole tensor."""
    hf_name: str
    transpose: bool = False
    offset: int = 0
    rows: int | None = None


def hf_sources(cfg: ModelConfig) -> dict[str, HFSource]:
    """{our global parameter name: HFSource} for every parameter of the full model cfg describes."""
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
            for ours in ("gate", "up", "down"):
                out[f"{me}.mlp.{ours}.weight"] = HFSource(f"{h}.mlp.{ours}_proj.weight")
        out["norm.weight"] = HFSource("model.norm.weight")
    out["head.weight"] = out["embed.weight"] if cfg.tied else HFSource("lm_head.weight")
    return out


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: shape} of the checkpoint cfg describes (fused tensors included once)."""
    layout = param_layout(build(cfg, device="meta"))
    sources = hf_sources(cfg)
    transposed = {src.hf_name for src in sources.values() if src.transpose}
    fused: dict[str, list] = {}
    for name, src in sources.items():
        if name not in layout:  # head.weight of a tied model: param_layout lists the shared tensor once
            continue
        shape = list(layout[name][0])
        if src.rows is not None:  # one part of a fused tensor: sum the parts along our dim 0
            acc = fused.setdefault(src.hf_name, [0] + shape[1:])
            acc[0] += shape[0]
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
        index = os.path.join(hf_dir, INDEX_FILE)
        single = os.path.join(hf_dir, WEIGHTS_FILE)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = dict(json.load(f)["weight_map"])
            except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
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

    def read(self, src: HFSource, slices: tuple[slice, ...], expected_shape: tuple[int, ...]) -> torch.Tensor:
        """The local slice of our tensor, read from the HF tensor without loading the rest of it."""
        key = self.file_of(src.hf_name)
        path = self.files[key]
        slices = list(slices)
        if src.rows is not None:  # shift our dim-0 slice to the part's rows inside the fused tensor
            s = slices[0]
            start, stop = s.start or 0, src.rows if s.stop is None else s.stop
            slices[0] = slice(src.offset + start, src.offset + stop)
        with self._open(path) as f:
            view = f.get_slice(key)
            shape = tuple(view.get_shape())
            if shape != tuple(expected_shape):
                raise ConfigError(f"model.init_from: tensor {key} in {path} must have shape "
                                  f"{tuple(expected_shape)} (from config.json), got {shape}; the weights do "
                                  "not match the config")
            part = view[tuple(slices[::-1])].t() if src.transpose else view[tuple(slices)]  # a copy
        return part


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
    sources, shapes = hf_sources(cfg), hf_shapes(cfg)
    params = dict(model.named_parameters(remove_duplicate=False))
    weights = HFWeights(hf_dir)
    for name, (_, slices) in param_layout(model).items():
        assert name in sources, f"parameter {name} has no Hugging Face source for family {cfg.family}"
        src = sources[name]
        params[name].copy_(weights.read(src, slices, shapes[src.hf_name]))
    return model

