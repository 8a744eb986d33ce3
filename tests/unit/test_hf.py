"""Hugging Face import and export against transformers itself, on tiny random models (no hub access).

Every HF parameter (norm weights and biases included) is drawn at random with a large std, so a
mapping mistake (two norms swapped, q/k/v out of order, a missing transpose) changes the logits.
The multi-process layouts (tp 2, pp 2) are in tests/dist/test_hf_parallel.py; both build their
tiny models with tests/harness.py.
"""
import dataclasses
import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from pipetrain.checkpoint.save import Checkpointer
from pipetrain.config import ConfigError, DataConfig, ModelConfig, Recipe
from pipetrain.data import IGNORE_INDEX, Loader, PackedData, load_tokenizer, prepare, tokenize_corpus
from pipetrain.hf.config import model_config_from_hf
from pipetrain.hf.export import export_model, export_state, main as export_main, parse_size
from pipetrain.hf.tokenizer import load_hf_tokenizer
from pipetrain.hf.weights import load_hf_weights
from pipetrain.kernels import cross_entropy
from pipetrain.models import build, materialize
from pipetrain.optim.build import build_optimizer
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.sft import encode_record
from tests.harness import HF_FP32, hf_configs, save_tiny_hf, tokens
from tests.unit.common import ModelState

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "pipetrain", "assets", "tokenizer")


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """{name: (dir, transformers model)} for each family plus a llama saved as a sharded index."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, cfg in hf_configs().items():
        out[name] = (str(root / name), save_tiny_hf(cfg, str(root / name)))
    sharded = str(root / "llama_sharded")
    out["llama_sharded"] = (sharded, save_tiny_hf(hf_configs()["llama"], sharded, seed=1, max_shard_size="20KB"))
    return out


def _load(hf_dir: str, recipe_model: ModelConfig | None = None):
    cfg = model_config_from_hf(hf_dir, recipe_model)
    return load_hf_weights(build(cfg), hf_dir, cfg), cfg


# ---- import ----

@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "gpt2", "llama_sharded"])
def test_imported_model_gives_transformers_logits(hf_models, name):
    hf_dir, hf_model = hf_models[name]
    model, _ = _load(hf_dir)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf_model(x).logits, **HF_FP32)


def test_sharded_checkpoint_is_read_through_its_index(hf_models):
    hf_dir, _ = hf_models["llama_sharded"]
    shards = [f for f in os.listdir(hf_dir) if f.endswith(".safetensors")]
    assert os.path.isfile(os.path.join(hf_dir, "model.safetensors.index.json")) and len(shards) > 2


def test_config_json_becomes_the_model_config(hf_models):
    assert model_config_from_hf(hf_models["llama"][0]) == ModelConfig(
        family="llama", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
        max_seq_len=64, tie_embeddings=False, rope_theta=5000.0, norm_eps=1e-6, qkv_bias=False,
        sliding_window=None, init_from=hf_models["llama"][0])
    qwen, mistral, gpt2 = (model_config_from_hf(hf_models[n][0]) for n in ("qwen2", "mistral", "gpt2"))
    assert (qwen.family, qwen.has_qkv_bias, qwen.sliding_window) == ("qwen2", True, None)
    assert (mistral.family, mistral.kv_heads, mistral.sliding_window) == ("mistral", 1, 5)
    assert (gpt2.family, gpt2.tied, gpt2.ffn, gpt2.max_seq_len) == ("gpt2", True, 128, 64)


def test_recipe_keys_left_at_defaults_are_filled_and_agreeing_keys_are_kept(hf_models):
    hf_dir = hf_models["llama"][0]
    cfg = model_config_from_hf(hf_dir, ModelConfig(n_layers=2, n_kv_heads=2, init_std=0.5))
    assert (cfg.n_layers, cfg.d_model, cfg.init_std, cfg.init_from) == (2, 32, 0.5, hf_dir)


def test_recipe_key_contradicting_config_json_names_both_values(hf_models):
    hf_dir = hf_models["llama"][0]
    with pytest.raises(ConfigError, match=r"model.d_model=64 contradicts .*config.json \(d_model=32\)"):
        model_config_from_hf(hf_dir, ModelConfig(d_model=64))
    with pytest.raises(ConfigError, match=r"model.family='gpt2' contradicts .*family='llama'"):
        model_config_from_hf(hf_dir, ModelConfig(family="gpt2"))


def test_gpt2_tied_head_is_the_embedding_after_loading(hf_models):
    model, _ = _load(hf_models["gpt2"][0])
    assert model.head.weight is model.embed.weight
    assert len(list(model.parameters())) == len(dict(model.named_parameters(remove_duplicate=False))) - 1


def _copy_with_config(src: str, dst, **changes) -> str:
    """A copy of src whose config.json has `changes` applied (None deletes a key)."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        raw = json.load(f)
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    with open(path, "w") as f:
        json.dump(raw, f)
    return str(dst)


@pytest.mark.parametrize("family,changes,pattern", [
    ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
     r"rope_parameters.rope_type must be 'default' .*got 'llama3'"),
    ("llama", dict(rope_parameters=None, rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2.0}),
     r"rope_scaling.rope_type must be 'default' .*got 'linear'"),
    ("llama", dict(attention_bias=True), r"attention_bias is not supported, got True"),
    ("llama", dict(mlp_bias=True), r"mlp_bias is not supported"),
    ("llama", dict(hidden_act="gelu"), r"hidden_act is not supported, got 'gelu'"),
    ("llama", dict(head_dim=16), r"head_dim != hidden_size/num_attention_heads is not supported, got 16"),
    ("llama", dict(quantization_config={"quant_method": "gptq"}), r"quantization_config is not supported"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, layer_types=None),
     r"a mix of sliding and full attention layers"),
    ("gpt2", dict(activation_function="relu"), r"activation_function is not supported, got 'relu'"),
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), r"scale_attn_by_inverse_layer_idx is not supported"),
    # a true / false field holds a JSON boolean: the string "false" was read as true (an untied lm_head dropped)
    ("llama", dict(tie_word_embeddings="false"), r"tie_word_embeddings must be true or false, got 'false'"),
    ("gpt2", dict(tie_word_embeddings="yes"), r"tie_word_embeddings must be true or false, got 'yes'"),
    ("qwen2", dict(use_sliding_window="false"), r"use_sliding_window must be true or false, got 'false'"),
    ("llama", dict(attention_bias="false"), r"attention_bias must be true or false, got 'false'"),
    # integers of 400 digits: float() overflowed (epsilon, theta) and so did the size check (vocab_size)
    ("llama", dict(rms_norm_eps=int("9" * 400)), r"rms_norm_eps must be a positive number, got 9999"),
    ("llama", dict(rope_parameters=None, rope_theta=int("9" * 400)), r"rope_theta must be a positive number, got 99"),
    ("llama", dict(vocab_size=int("9" * 400)), r"vocab_size must be a positive integer below 2\*\*63, got 9999"),
])
def test_unsupported_config_option_is_rejected_by_name(hf_models, tmp_path, family, changes, pattern):
    hf_dir = _copy_with_config(hf_models[family][0], tmp_path / "m", **changes)
    with pytest.raises(ConfigError, match=pattern):
        model_config_from_hf(hf_dir)


def test_unsupported_architecture_is_rejected(tmp_path):
    from transformers import BertConfig

    BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"model_type must be one of llama, qwen2, mistral, gpt2, mixtral, qwen3_moe, got 'bert'"):
        model_config_from_hf(str(tmp_path))


def test_directory_without_config_or_weights_is_rejected(hf_models, tmp_path):
    with pytest.raises(ConfigError, match=r"config.json not found"):
        model_config_from_hf(str(tmp_path))
    with pytest.raises(ConfigError, match=r"directory not found"):
        model_config_from_hf(str(tmp_path / "absent"))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(os.path.join(hf_models["llama"][0], "config.json"), no_weights)
    (no_weights / "pytorch_model.bin").write_bytes(b"")
    cfg = model_config_from_hf(str(no_weights))
    with pytest.raises(ConfigError, match=r"neither model.safetensors nor .*got weight files \['pytorch_model.bin'\]"):
        load_hf_weights(build(cfg), str(no_weights), cfg)


def test_tensor_shape_mismatch_and_missing_tensor_name_the_tensor_and_file(hf_models, tmp_path):
    hf_dir = hf_models["llama"][0]
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    bad = tmp_path / "bad_shape"
    shutil.copytree(hf_dir, bad)
    save_file({**state, "model.layers.1.mlp.up_proj.weight": torch.zeros(60, 32)}, str(bad / "model.safetensors"))
    cfg = model_config_from_hf(str(bad))
    with pytest.raises(ConfigError, match=r"tensor model.layers.1.mlp.up_proj.weight in .*bad_shape/model.safetensors "
                                          r"must have shape \(64, 32\) .*got \(60, 32\)"):
        load_hf_weights(build(cfg), str(bad), cfg)
    missing = tmp_path / "missing"
    shutil.copytree(hf_dir, missing)
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, str(missing / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"tensor lm_head.weight is missing from .*missing/model.safetensors"):
        load_hf_weights(build(cfg), str(missing), cfg)
    # a NaN weight trained into "loss is nan ... lower train.lr" (exit 1) at the first step
    nan = tmp_path / "nan_weight"
    shutil.copytree(hf_dir, nan)
    save_file({**state, "model.norm.weight": torch.full_like(state["model.norm.weight"], float("nan"))},
              str(nan / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"weight model.norm.weight holds NaN or inf values; the model folder is "):
        load_hf_weights(build(cfg), str(nan), cfg)
    # a weight stored as an integer, bool, complex or float8 tensor was cast into the fp32 masters silently
    for dtype in (torch.int32, torch.bool, torch.complex64, torch.float8_e4m3fn):
        odd = tmp_path / f"dtype-{str(dtype).split('.')[1]}"
        shutil.copytree(hf_dir, odd)
        norm = state["model.norm.weight"]
        save_file({**state, "model.norm.weight": norm.to(dtype)}, str(odd / "model.safetensors"))
        with pytest.raises(ConfigError, match=r"tensor model.norm.weight in .* is [A-Z0-9_]+, where a model's weights "
                                              r"are one of F32, F16, BF16, F64"):
            load_hf_weights(build(cfg), str(odd), cfg)


def test_tokenizer_larger_than_the_model_vocab_is_rejected():
    small = ModelConfig(vocab_size=64)
    with pytest.raises(ConfigError, match=r"data.tokenizer: the tokenizer has 8192 tokens, more than .*vocab_size=64"):
        load_hf_tokenizer(TOKENIZER, small)
    assert len(load_hf_tokenizer(TOKENIZER, ModelConfig(vocab_size=8192))) == 8192


# ---- export ----

EXPORT_CASES = {
    "llama_gqa": ModelConfig(family="llama", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                             ffn_hidden=64, max_seq_len=32, rope_theta=500.0, norm_eps=1e-6),
    "qwen2_sliding": ModelConfig(family="qwen2", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1,
                                 ffn_hidden=64, max_seq_len=32, sliding_window=4),
    "mistral_tied": ModelConfig(family="mistral", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                ffn_hidden=64, max_seq_len=32, sliding_window=6, tie_embeddings=True),
    "gpt2": ModelConfig(family="gpt2", vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=32),
    "gpt2_untied": ModelConfig(family="gpt2", vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=32,
                               tie_embeddings=False),
}


def random_model(cfg: ModelConfig):
    """A pipetrain model with large random weights (norms and biases included)."""
    model = materialize(build(cfg), cfg, 7, "cpu")
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


@pytest.mark.parametrize("case", sorted(EXPORT_CASES))
def test_exported_model_gives_pipetrain_logits_in_transformers(tmp_path, case):
    from transformers import AutoModelForCausalLM

    cfg = EXPORT_CASES[case]
    model = random_model(cfg)
    export_model(model, cfg, str(tmp_path))
    hf_model = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf_model(x).logits, model(x), **HF_FP32)
    assert model_config_from_hf(str(tmp_path)).ffn == cfg.ffn


def test_export_streams_in_any_order_and_shards_above_the_cap(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = EXPORT_CASES["gpt2"]
    model = random_model(cfg)
    named = list(model.named_parameters(remove_duplicate=False))[::-1]  # c_attn's parts arrive v, k, q
    files = export_state(iter(named), cfg, str(tmp_path), max_shard_bytes=parse_size("16KB"))
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 3 and "model.safetensors.index.json" in files
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    hf_model = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    reimported, _ = _load(str(tmp_path))
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf_model(x).logits, model(x), **HF_FP32)
        assert torch.equal(reimported(x), model(x))


def test_export_in_bf16_halves_the_files_and_keeps_the_values_rounded(tmp_path):
    cfg = EXPORT_CASES["llama_gqa"]
    model = random_model(cfg)
    export_model(model, cfg, str(tmp_path / "fp32"))
    export_model(model, cfg, str(tmp_path / "bf16"), dtype=torch.bfloat16)
    fp32 = os.path.getsize(tmp_path / "fp32" / "model.safetensors")
    bf16 = os.path.getsize(tmp_path / "bf16" / "model.safetensors")
    assert bf16 < 0.55 * fp32
    got = load_file(str(tmp_path / "bf16" / "model.safetensors"))["model.layers.1.mlp.up_proj.weight"]
    assert got.dtype == torch.bfloat16 and torch.equal(got, model.layers["1"].mlp.up.weight.bfloat16())


def test_export_copies_the_tokenizer_and_records_its_special_ids(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    cfg = ModelConfig(family="llama", vocab_size=8192, d_model=32, n_layers=1, n_heads=4, ffn_hidden=64,
                      max_seq_len=32)
    files = export_model(random_model(cfg), cfg, str(tmp_path), tokenizer_dir=TOKENIZER)
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(files)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok("To be, or not")["input_ids"] == AutoTokenizer.from_pretrained(TOKENIZER)("To be, or not")["input_ids"]
    assert AutoConfig.from_pretrained(str(tmp_path)).eos_token_id == tok.eos_token_id


def test_export_rejects_bad_input(tmp_path):
    cfg = EXPORT_CASES["llama_gqa"]
    model = random_model(cfg)
    state = dict(model.named_parameters())
    with pytest.raises(ConfigError, match=r"tensors never arrived, got none for \['model.norm.weight'\]"):
        export_state({k: v for k, v in state.items() if k != "norm.weight"}, cfg, str(tmp_path / "a"))
    with pytest.raises(ConfigError, match=r"layers.0.attn.wq.weight must have shape \(32, 32\) .*got \(16, 32\)"):
        export_state({**state, "layers.0.attn.wq.weight": torch.zeros(16, 32)}, cfg, str(tmp_path / "b"))
    with pytest.raises(ConfigError, match=r"tensor optim.step is not a parameter"):
        export_state({**state, "optim.step": torch.zeros(())}, cfg, str(tmp_path / "c"))
    export_model(model, cfg, str(tmp_path / "d"))
    with pytest.raises(ConfigError, match=r"already holds a model"):
        export_model(model, cfg, str(tmp_path / "d"))
    (tmp_path / "f").write_text("a file")
    with pytest.raises(ConfigError, match=r"OUT .*/f is an existing file"):
        export_model(model, cfg, str(tmp_path / "f"))
    # the user's own tokenizer files are model files too when a tokenizer is copied in; the tokenizer folder
    # itself (a SameFileError traceback, with model.safetensors left in it) and unwritable places are refused
    cfg = dataclasses.replace(cfg, vocab_size=8192)  # the shipped tokenizer's
    model = random_model(cfg)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "tokenizer.json").write_text("my own")
    with pytest.raises(ConfigError, match=r"already holds a model, got \['tokenizer.json'\]"):
        export_model(model, cfg, str(mine), tokenizer_dir=TOKENIZER)
    assert (mine / "tokenizer.json").read_text() == "my own" and os.listdir(mine) == ["tokenizer.json"]
    tokenizer_copy = tmp_path / "tok"
    shutil.copytree(TOKENIZER, tokenizer_copy)
    with pytest.raises(ConfigError, match=r"is inside the tokenizer folder"):
        export_model(model, cfg, str(tokenizer_copy), tokenizer_dir=str(tokenizer_copy))
    assert not any(f.endswith(".safetensors") for f in os.listdir(tokenizer_copy))
    with pytest.raises(ConfigError, match=r"OUT .*/f/sub cannot be written"):
        export_model(model, cfg, str(tmp_path / "f" / "sub"))
    gqa_gpt2 = ModelConfig(family="gpt2", vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2)
    with pytest.raises(ConfigError, match=r"gpt2 has no grouped-query attention"):
        export_model(random_model(gqa_gpt2), gqa_gpt2, str(tmp_path / "e"))


def test_a_shard_size_of_any_length_is_a_size():
    """400 digits were a float of inf, and int(inf) an OverflowError traceback from export and consolidate."""
    assert parse_size("9" * 400 + "GB") == int("9" * 400) * 10 ** 9
    assert parse_size("1.5KiB") == 1536 and parse_size("2GB") == 2 * 10 ** 9 and parse_size("1000") == 1000


def test_export_never_writes_through_a_generation_config_link_in_out(tmp_path):
    """OUT holding generation_config.json, a link to a file outside it, was written through: the export replaced
    that file's contents and exited 0. It is a model file, refused as the others are."""
    cfg = dataclasses.replace(EXPORT_CASES["llama_gqa"], vocab_size=8192)  # the shipped tokenizer's
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(victim, out / "generation_config.json")
    with pytest.raises(ConfigError, match=r"already holds a model, got \['generation_config.json'\]"):
        export_model(random_model(cfg), cfg, str(out), tokenizer_dir=TOKENIZER)
    assert victim.read_text() == "precious" and os.listdir(out) == ["generation_config.json"]


def _save_checkpoint(model, recipe, out_dir: str) -> str:
    """A real pipetrain checkpoint (pipetrain.checkpoint.save.Checkpointer) of model, saved by one process."""
    dims = ParallelDims()
    state = ModelState(model, build_optimizer(model, dims, recipe.train), dims, 3, {"samples": 0})
    return Checkpointer(out_dir, recipe, dims).save(state)


def test_export_cli_writes_a_checkpoint_transformers_loads_with_its_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer


    cfg = ModelConfig(family="llama", vocab_size=8192, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      ffn_hidden=64, max_seq_len=32, tie_embeddings=True)
    model = random_model(cfg)
    recipe = Recipe(model=cfg, data=DataConfig(path="x", tokenizer=TOKENIZER))  # export copies this tokenizer
    ckpt = _save_checkpoint(model, recipe, str(tmp_path / "run"))
    out = tmp_path / "out"
    assert export_main(["export", ckpt, str(out), "--max-shard-size", "600KB"]) == 0
    assert os.path.isfile(out / "model.safetensors.index.json") and os.path.isfile(out / "tokenizer.json")
    hf_model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    x = tokens(8192)
    with torch.no_grad():
        torch.testing.assert_close(hf_model(x).logits, model(x), **HF_FP32)
    assert AutoTokenizer.from_pretrained(str(out)).vocab_size == 8192


# ---- fine-tuning data (pipetrain/sft.py, pipetrain/data/) with a chat-template tokenizer ----

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris"}, {"role": "user", "content": "And Italy?"},
        {"role": "assistant", "content": "Rome"}]


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """The shipped BPE tokenizer plus role markers and a Jinja chat template, saved and reloaded."""
    tok = load_tokenizer(TOKENIZER)
    tok.add_special_tokens({"additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]})
    tok.chat_template = CHAT_TEMPLATE
    path = str(tmp_path_factory.mktemp("chat_tokenizer"))
    tok.save_pretrained(path)
    return load_tokenizer(path)


def test_chat_records_train_only_the_assistant_turns(chat_tokenizer):
    ids, mask = encode_record({"messages": CHAT}, chat_tokenizer)
    rendered = chat_tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert chat_tokenizer.decode(ids) == rendered + "<|endoftext|>"
    trained = chat_tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert trained == "Paris<|end|>\nRome<|end|>\n<|endoftext|>"  # not the "<|assistant|>\n" that opens a turn


def test_a_conversation_opening_with_the_assistant_trains_its_turn_and_a_refusing_template_is_one_line(
        chat_tokenizer, monkeypatch):
    """The assistant's first turn has the empty conversation as its prompt, which templates refuse (a ValueError
    traceback); a template that raises (its own raise_exception, or jinja's sandbox) is the data's fault: one line."""
    ids, mask = encode_record({"messages": [{"role": "assistant", "content": "hello"}]}, chat_tokenizer)
    assert chat_tokenizer.decode([i for i, m in zip(ids, mask) if m]) == chat_tokenizer.decode(ids)
    monkeypatch.setattr(chat_tokenizer, "chat_template", "{{ raise_exception('no system turns here') }}")
    with pytest.raises(ConfigError, match=r"chat template cannot render a conversation \(no system turns here\)"):
        encode_record({"messages": CHAT}, chat_tokenizer)


def test_chat_records_without_an_assistant_turn_are_refused_at_prepare(tmp_path, chat_tokenizer):
    """Nothing to train on: the run stopped with a ZeroDivisionError at its first step, and again at every resume."""
    path = tmp_path / "user_only.jsonl"
    path.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"hi {i}"}]}) for i in range(5)))
    with pytest.raises(ConfigError, match=r"has no token to train on: no record has a completion or an assistant"):
        prepare(str(path), chat_tokenizer, cache_dir=str(tmp_path / "cache"), progress=False)
    assert not [p for p in os.listdir(tmp_path / "cache") if p.startswith("prepared-")]  # nothing half-prepared kept


@pytest.mark.parametrize("content", ["{}", "[1, 2]", '{"added_tokens": [], "model": 5}'])
def test_a_tokenizer_json_of_the_wrong_structure_is_one_line(tmp_path, content):
    """Valid JSON, wrong structure: KeyError, TypeError or tokenizers' bare Exception, each a traceback before."""
    shutil.copytree(TOKENIZER, tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer.json").write_text(content)
    with pytest.raises(ConfigError, match=r"data.tokenizer: cannot load .* use a local directory with tokenizer.json"):
        load_tokenizer(str(tmp_path / "tok"))


def _sft_jsonl(path, n: int = 40) -> None:
    """Chat and prompt/completion records of varied lengths (one file holds one record shape)."""
    rows = [{"messages": [{"role": "user", "content": f"Count to {i}."},
                          {"role": "assistant", "content": " ".join(str(j) for j in range(i))}]} for i in range(1, n)]
    path.write_text("\n".join(json.dumps(r) for r in rows))


def test_chat_jsonl_is_tokenised_with_the_assistant_mask(tmp_path, chat_tokenizer):
    path = tmp_path / "chat.jsonl"
    _sft_jsonl(path, 6)
    tokens, mask = tokenize_corpus(DataConfig(path=str(path), cache_dir=str(tmp_path / "cache")), chat_tokenizer)
    expected = [encode_record(json.loads(line), chat_tokenizer) for line in path.read_text().splitlines()]
    assert tokens.tolist() == [i for ids, _ in expected for i in ids]
    assert mask.tolist() == [m for _, ms in expected for m in ms]
    assert 0 < mask.sum() < len(mask) / 2


def test_fine_tuning_loss_is_the_mean_over_trained_tokens_of_the_whole_global_batch(tmp_path, chat_tokenizer):
    path = tmp_path / "chat.jsonl"
    _sft_jsonl(path)
    tokens, mask = tokenize_corpus(DataConfig(path=str(path), cache_dir=str(tmp_path / "cache")), chat_tokenizer)
    data = PackedData(tokens, mask, seq_len=32, val_fraction=0.0, seed=0)
    global_batch, dp, vocab = 8, 2, len(chat_tokenizer)
    whole = data.train_batch(0, global_batch)
    logits = torch.randn(global_batch, 32, vocab, generator=torch.Generator().manual_seed(0))
    reference = F.cross_entropy(logits.flatten(0, 1), whole.targets.flatten(), ignore_index=IGNORE_INDEX)
    total_loss = 0.0
    for dp_rank in range(dp):
        batch, total = Loader(data, global_batch, dp_rank, dp).next()
        assert total == int((whole.targets != IGNORE_INDEX).sum()) < global_batch * 32  # global, masked count
        rows = logits[dp_rank * 4:(dp_rank + 1) * 4]
        for micro_logits, micro in zip(rows.chunk(2), batch.split(2)):  # 2 microbatches per rank
            count = int((micro.targets != IGNORE_INDEX).sum())
            if count:  # the trainer's contribution: sum of CE over this microbatch / global trained count
                total_loss += float(cross_entropy(micro_logits, micro.targets, IGNORE_INDEX)) * count / total
    torch.testing.assert_close(torch.tensor(total_loss), reference, rtol=1e-5, atol=1e-6)


def _as_cache_snapshot(src: str, cache) -> str:
    """src laid out as a Hugging Face cache holds it: snapshots/<revision>/<file> -> ../../blobs/<hash>."""
    repo = cache / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    for i, name in enumerate(sorted(os.listdir(src))):
        shutil.copy(os.path.join(src, name), repo / "blobs" / f"blob{i}")
        os.symlink(os.path.join("..", "..", "blobs", f"blob{i}"), snap / name)
    return str(snap)


def test_a_model_or_tokenizer_folder_is_read_only_inside_itself(hf_models, tmp_path):
    """Nothing is read from outside the folder given: a config.json, weight file or tokenizer file that links out
    of its folder is refused before anything is read, in one line. A Hugging Face cache snapshot's files, links
    into its own repository's blobs, load, and so does a folder that is itself a link."""
    src = hf_models["llama"][0]
    for name in ("config.json", "model.safetensors"):
        linked = tmp_path / f"linked-{name}"
        shutil.copytree(src, linked)
        os.remove(linked / name)
        os.symlink(os.path.join(src, name), linked / name)  # the same bytes, but outside the folder
        with pytest.raises(ConfigError, match=rf"model.init_from: .*{name} links outside the folder .*copy the file"):
            _load(str(linked))
    tok = tmp_path / "tok"
    shutil.copytree(TOKENIZER, tok)
    os.remove(tok / "tokenizer.json")
    os.symlink(os.path.join(TOKENIZER, "tokenizer.json"), tok / "tokenizer.json")
    with pytest.raises(ConfigError, match=r"data.tokenizer: .*tokenizer.json links outside the folder"):
        load_tokenizer(str(tok))
    other = tmp_path / "cache-other" / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    snap = _as_cache_snapshot(src, tmp_path / "cache")
    model, _ = _load(snap)  # links into its own blobs: the cache's layout
    reference, _ = _load(src)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    os.remove(os.path.join(snap, "config.json"))  # a snapshot's link into another repository's blobs: outside
    shutil.copy(os.path.join(src, "config.json"), other / "x")
    os.symlink(other / "x", os.path.join(snap, "config.json"))
    with pytest.raises(ConfigError, match=r"config.json links outside the folder"):
        _load(snap)
    os.symlink(src, tmp_path / "folder-link")
    _load(str(tmp_path / "folder-link"))
    assert load_tokenizer(_as_cache_snapshot(TOKENIZER, tmp_path / "tok-cache")).eos_token_id is not None


def test_a_chat_template_that_never_ends_is_one_line(chat_tokenizer, monkeypatch):
    """A template's loops run as long as they are written to (jinja's sandbox bounds each range, not their
    nesting): prepare hung on it. One conversation's rendering is bounded in time (pipetrain.sft)."""
    import pipetrain.sft
    monkeypatch.setattr(pipetrain.sft, "RENDER_SECONDS", 0.5)
    monkeypatch.setattr(chat_tokenizer, "chat_template", "{% for i in range(100000) %}{% for j in range(100000) %}"
                                                         "{% endfor %}{% endfor %}x")
    with pytest.raises(ConfigError, match=r"chat template took more than 0.5 s to render one conversation of 5 "
                                          r"messages .*fix the template or split the conversation"):
        encode_record({"messages": CHAT}, chat_tokenizer)
    monkeypatch.setattr(chat_tokenizer, "chat_template", CHAT_TEMPLATE)
    assert encode_record({"messages": CHAT}, chat_tokenizer)[0]  # the limit is gone: no alarm left behind


def test_export_keeps_a_dense_head_dim_and_refuses_dense_qk_norms(tmp_path):
    """Found by a review: a qwen2 with model.head_dim 16 (d_model/n_heads 8) exported a config.json without it,
    which transformers could not load; a dense model with q/k norms exported as a class without them (other
    logits, exit 0)."""
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig(family="qwen2", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      ffn_hidden=64, max_seq_len=32, head_dim_=16)
    model = random_model(cfg)
    export_model(model, cfg, str(tmp_path / "head_dim"))
    hf_model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "head_dim")).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tokens()).logits, model(tokens()), **HF_FP32)
    normed = dataclasses.replace(cfg, head_dim_=None, qk_norm=True)
    with pytest.raises(ConfigError, match=r"export: a dense qwen2 model with q/k norms has no Hugging Face class"):
        export_model(random_model(normed), normed, str(tmp_path / "qk_norm"))
    assert not (tmp_path / "qk_norm").exists() or not os.listdir(tmp_path / "qk_norm")


def test_weights_with_more_layers_than_config_json_are_refused(hf_models, tmp_path):
    """Found by a review: num_hidden_layers=1 in config.json beside the weights of 2 layers loaded layer 0 and
    dropped layer 1 without a word."""
    src = hf_models["llama"][0]
    folder = tmp_path / "fewer"
    shutil.copytree(src, folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"weights hold layer 1 \(of 2\), but config.json gives 1 layers"):
        _load(str(folder))
    _load(hf_models["gpt2"][0])  # transformer.h.N names: every layer in the config
