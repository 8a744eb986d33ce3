"""Hugging Face config.json -> ModelConfig, for model.init_from.

model_config_from_hf(hf_dir, recipe_model) reads config.json of a llama, qwen2, mistral, gpt2, mixtral
or qwen3_moe model (transformers 4.x and 5 key names alike). Every option pipetrain cannot reproduce exactly (RoPE scaling, o_proj/MLP biases, other
activations, a head_dim other than d_model/n_heads, mixed sliding/full layers, ...) is a ConfigError
naming the option. A recipe model key is "set by the user" when it differs from ModelConfig()'s
default; such a key must agree with config.json (else a ConfigError names both values), and every
key left at its default is filled from config.json. (So a recipe that spells out a default value,
e.g. vocab_size: 8192, cannot be told apart from one that omits it; it is simply filled.)

May import: config, folders, jsonfile. Never: models, parallel, trainer, build, cli.
"""
from __future__ import annotations

import dataclasses
import math
import os

from pipetrain.config import ConfigError, ModelConfig, clip, positive_finite
from pipetrain.folders import refuse_folder_links_outside
from pipetrain.jsonfile import read_json

CONFIG_FILE = "config.json"
CONFIG_MAX_BYTES = 16 << 20  # a config.json is a few KB; anything near this is not one
FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
            "gpt2": "GPT2LMHeadModel", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
MOE_FAMILIES = ("mixtral", "qwen3_moe")
# Recipe keys that config.json defines; the rest (init_from, init_std) stay as the recipe has them.
HF_KEYS = ("family", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len",
           "tie_embeddings", "rope_theta", "norm_eps", "qkv_bias", "sliding_window", "num_experts",
           "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "qk_norm", "head_dim_")
RECIPE_KEY = {"head_dim_": "head_dim"}  # a field whose recipe key differs (schema.KEY_ALIASES)
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both are GELU's tanh approximation, as ours


def read_hf_config(hf_dir: str) -> dict:
    """config.json of a local HF model directory as a dict (ConfigError when absent or unreadable)."""
    path = os.path.join(hf_dir, CONFIG_FILE)
    if not os.path.isdir(hf_dir):
        raise ConfigError(f"model.init_from: directory not found, got {hf_dir!r}; point it at a local "
                          "Hugging Face model folder (config.json + model.safetensors)")
    refuse_folder_links_outside(hf_dir, "model.init_from")
    if not os.path.isfile(path):
        raise ConfigError(f"model.init_from: {path} not found; the folder needs the model's config.json "
                          "(save_pretrained writes it)")
    raw = read_json(path, "model.init_from", ConfigError, "re-save the model", CONFIG_MAX_BYTES)
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
    if not positive_finite(theta):
        problems.append(f"{path}: rope_theta must be a positive number, got {clip(repr(theta))}")
        return 10000.0
    return float(theta)


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
        # below 2**63: an integer of 400 digits overflowed the float arithmetic of the size check
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value < 2 ** 63:
            problems.append(f"{path}: {key} must be a positive integer below 2**63, got {clip(repr(value))}")
            return 1
        return value

    def flag(key: str, default: bool) -> bool:
        """A true / false field (default when absent or null): a JSON boolean, never a string's truthiness (the
        string "false" read as true dropped an untied model's lm_head)."""
        value = raw.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            problems.append(f"{path}: {key} must be true or false, got {clip(repr(value))}")
            return default
        return value

    def num(key: str, default: float) -> float:
        """A positive finite number field (epsilons)."""
        value = raw.get(key, default)
        if not positive_finite(value):
            problems.append(f"{path}: {key} must be a positive number, got {clip(repr(value))}")
            return default
        return float(value)

    need(raw.get("quantization_config") is None, "quantization_config", raw.get("quantization_config"),
         "use unquantized (fp32/bf16/fp16) weights")
    if family == "gpt2":
        d, heads = req("n_embd"), req("n_head")
        act = raw.get("activation_function", "gelu_new")
        need(act in GPT2_ACTIVATIONS, "activation_function", act, f"use one of {', '.join(GPT2_ACTIVATIONS)}")
        need(flag("scale_attn_weights", True), "scale_attn_weights=false",
             raw.get("scale_attn_weights"), "use 1/sqrt(head_dim) attention scaling")
        for name in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
            need(not flag(name, False), name, raw.get(name), "set it to false")
        out = dict(family=family, vocab_size=req("vocab_size"), d_model=d, n_layers=req("n_layer"),
                   n_heads=heads, n_kv_heads=heads, ffn_hidden=req("n_inner", 4 * d),
                   max_seq_len=req("n_positions"), tie_embeddings=flag("tie_word_embeddings", True),
                   norm_eps=num("layer_norm_epsilon", 1e-5))
    else:
        d, heads = req("hidden_size"), req("num_attention_heads")
        act = raw.get("hidden_act", "silu")
        need(act == "silu", "hidden_act", act, "pipetrain's gated MLP is SwiGLU (silu)")
        need(not flag("attention_bias", False), "attention_bias", raw.get("attention_bias"),
             "pipetrain's llama layers have no q/k/v/o biases (qwen2 has q/k/v biases only)")
        need(not flag("mlp_bias", False), "mlp_bias", raw.get("mlp_bias"), "use a model without MLP biases")
        head_dim = raw.get("head_dim")
        if family in MOE_FAMILIES:  # model.head_dim holds any even size
            head_dim = req("head_dim", d // heads)
            need(head_dim % 2 == 0, "an odd head_dim", head_dim, "RoPE needs an even head_dim")
        else:
            need(head_dim is None or (isinstance(head_dim, int) and head_dim == d // heads),
                 "head_dim != hidden_size/num_attention_heads", head_dim,
                 f"pipetrain derives head_dim={d // heads} from hidden_size={d} and num_attention_heads={heads}")
        window = None
        if family in ("mistral", "mixtral") or (family == "qwen2" and flag("use_sliding_window", False)):
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
                   tie_embeddings=flag("tie_word_embeddings", False),
                   rope_theta=_rope_theta(raw, path, problems), norm_eps=num("rms_norm_eps", 1e-6),
                   qkv_bias=family == "qwen2", sliding_window=window, num_experts=0)
        if family in MOE_FAMILIES:
            out.update(_moe_values(raw, family, path, need, req, flag),
                       head_dim_=None if head_dim == d // heads else head_dim)
    if not problems:
        need(out.get("head_dim_") is not None or out["d_model"] % out["n_heads"] == 0, "hidden size not divisible by the head count",
             (out["d_model"], out["n_heads"]), "pipetrain needs d_model % n_heads == 0")
        need(out["n_heads"] % out["n_kv_heads"] == 0, "heads not divisible by key/value heads",
             (out["n_heads"], out["n_kv_heads"]), "use a model whose kv heads divide its heads")
    if problems:
        raise ConfigError("; ".join(problems))
    return out


def _moe_values(raw: dict, family: str, path: str, need, req, flag) -> dict:
    """The mixture-of-experts keys of a mixtral / qwen3_moe config.json (need / req / flag: _hf_values' checks)."""
    experts_key = "num_local_experts" if "num_local_experts" in raw else "num_experts"  # transformers 5 / 4.x
    out = dict(num_experts=req(experts_key), num_experts_per_tok=req("num_experts_per_tok"))
    if family == "mixtral":
        jitter = raw.get("router_jitter_noise", 0.0)
        need(not jitter, "router_jitter_noise", jitter, "set it to 0 (pipetrain's router adds no noise)")
        out.update(moe_intermediate_size=req("intermediate_size"), norm_topk_prob=True, qk_norm=False)
    else:
        step, only = raw.get("decoder_sparse_step", 1), raw.get("mlp_only_layers") or []
        need(step == 1, "decoder_sparse_step != 1 (dense layers between sparse ones)", step,
             "use a model whose every layer is a mixture of experts")
        need(not only, "mlp_only_layers (dense layers among the sparse ones)", only,
             "use a model whose every layer is a mixture of experts")
        need(not flag("use_sliding_window", False), "use_sliding_window", raw.get("use_sliding_window"),
             "set it to false")
        norm = raw.get("norm_topk_prob", False)
        need(isinstance(norm, bool), "a non-boolean norm_topk_prob", norm, "use true or false")
        out.update(moe_intermediate_size=req("moe_intermediate_size"), norm_topk_prob=bool(norm), qk_norm=True)
    if out["num_experts_per_tok"] > out["num_experts"]:
        need(False, "num_experts_per_tok > the expert count", out["num_experts_per_tok"],
             f"use at most {out['num_experts']}")
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
            key = RECIPE_KEY.get(key, key)
            problems.append(f"model.{key}={mine!r} contradicts {path} ({key}={hf_value!r}); remove model.{key} "
                            "from the recipe (model.init_from defines it) or point init_from at another model")
    if problems:
        raise ConfigError("; ".join(problems))
    return dataclasses.replace(recipe_model, init_from=hf_dir, **values)
