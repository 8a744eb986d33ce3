"""A complete Hugging Face export of a tiny chat model: generation_config.json copied from the source
(or written from the tokenizer's ids), the source dtype kept by default (--dtype overrides), the chat
template carried, and transformers' generate() stopping at the exported EOS."""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig

from pipetrain.hf.config import model_config_from_hf
from pipetrain.hf.export import export_model
from pipetrain.hf.weights import load_hf_weights
from pipetrain.models import build, materialize
from tests.harness import ROOT, save_tiny_hf
from tests.unit.common import LLAMA

TOKENIZER = os.path.join(ROOT, "pipetrain", "assets", "tokenizer")
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
MESSAGES = [{"role": "user", "content": "Who wrote Hamlet?"}]


def _chat_model(out_dir, generation: dict | None):
    """A tiny bf16 llama with the asset tokenizer plus a chat template (and a generation_config.json)."""
    cfg = LlamaConfig(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    model = save_tiny_hf(cfg, str(out_dir))
    model.to(torch.bfloat16).save_pretrained(str(out_dir))
    if generation is not None:
        GenerationConfig(**generation).save_pretrained(str(out_dir))
    elif os.path.exists(os.path.join(out_dir, "generation_config.json")):
        os.remove(os.path.join(out_dir, "generation_config.json"))
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(out_dir))
    return tok


def _export(hf_dir, out_dir, dtype=None):
    cfg = model_config_from_hf(str(hf_dir))
    model = load_hf_weights(build(cfg, device="meta"), str(hf_dir), cfg)
    return export_model(model, cfg, str(out_dir), tokenizer_dir=str(hf_dir), dtype=dtype)


def _greedy(model_dir, prompt_ids, **kw):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model.generate(prompt_ids, do_sample=False, max_new_tokens=8, **kw)[0, prompt_ids.shape[1]:].tolist()


def test_chat_model_export_carries_generation_config_template_and_stops_at_eos(tmp_path):
    # The EOS is a token the model produces greedily at its 4th step, so stopping there is observable.
    tok = _chat_model(tmp_path / "probe", None)
    prompt = torch.tensor([tok(tok.apply_chat_template(MESSAGES, tokenize=False))["input_ids"]])
    free = _greedy(str(tmp_path / "probe"), prompt, eos_token_id=None, pad_token_id=0)
    eos = free[3]
    stop = free.index(eos) + 1
    assert stop < 8
    source = tmp_path / "chat"
    _chat_model(source, {"eos_token_id": eos, "pad_token_id": eos, "bos_token_id": 0, "do_sample": False})
    out = tmp_path / "export"
    files = _export(source, out)
    assert "generation_config.json" in files and "config.json" in files
    assert GenerationConfig.from_pretrained(str(out)).eos_token_id == eos
    exported_tok = AutoTokenizer.from_pretrained(str(out))
    assert exported_tok.chat_template == TEMPLATE
    assert exported_tok(exported_tok.apply_chat_template(MESSAGES, tokenize=False))["input_ids"] == prompt[0].tolist()
    with open(out / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"  # the source dtype by default
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    got = _greedy(str(out), prompt)  # generate() reads the exported generation_config.json
    assert got == free[:stop] and got[-1] == eos


def test_generation_config_written_from_tokenizer_and_dtype_override(tmp_path):
    _chat_model(tmp_path / "chat", None)
    out = tmp_path / "export"
    _export(tmp_path / "chat", out, dtype=torch.float32)
    with open(out / "generation_config.json") as f:
        written = json.load(f)
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    assert written["eos_token_id"] == tok.eos_token_id
    assert written["pad_token_id"] == tok.eos_token_id  # the tokenizer has no pad token: pad = eos
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.float32


def test_model_trained_from_scratch_exports_fp32(tmp_path):
    model = materialize(build(LLAMA, device="meta"), LLAMA, 0, "cpu")
    export_model(model, LLAMA, str(tmp_path / "e"))
    with safe_open(str(tmp_path / "e" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.float32
