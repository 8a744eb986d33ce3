"""LoRA, Hugging Face import/export, generation and SFT cases the default suite does not check, each
against transformers (tiny random configs saved locally), a hand computation, or the documented rule.

A mutation audit of pipetrain/models/lora.py, parallel/tensor/lora.py, hf/, generate/, lr_schedule.py,
sft.py and data/order.py found realistic bugs that the default suite let through; each test here fails
on one of them within seconds:
- LoRA dropout applied in eval mode too (Trainer.evaluate of a run with lora_dropout > 0 noisy and biased);
- lora_A drawn with bound 1/sqrt(r) instead of PEFT's 1/sqrt(D_in), or from a seed that ignores the
  projection's global name (every layer's wq starting from the same A);
- a LoRA checkpoint's adapters read back wrongly for the merged export and generation (transposed when
  square: lora_rank == d_model), and `export --peft --dtype bf16` ignoring --dtype;
- a config.json written without the keys transformers leaves at their defaults (tie_word_embeddings,
  num_key_value_heads), read with other defaults (a llama tied, or one kv head);
- qwen2 with use_sliding_window but every layer below max_window_layers (full attention in transformers)
  imported with the window;
- a GPT-2 checkpoint whose names lack the "transformer." prefix (as openai-community/gpt2's own file)
  refused instead of read as transformers reads it;
- sampling that takes the nucleus (top-p) on the untempered distribution: transformers, and the CLI's
  --temperature --top-p, temper first;
- SFT: a chat template that closes the conversation with EOS given a second EOS;
- the window order's Feistel domain for a power-of-two window count (n.bit_length() for (n - 1).bit_length():
  still a seeded bijection, but another order, so every resumed checkpoint of such a run would read other
  windows; the golden values in tests/unit/test_data.py only pin counts that are not powers of two).
The shipped code passes every test here. Survivors left without a test: merge_lora keeping the adapters'
param_shards entries (equivalent: it merges one-process models only, which hold no shards). wsd's decay
length by int() instead of round() is now caught by tests/unit/test_lr_schedule.py (the docstring fixes it).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pipetrain.checkpoint.read import iter_full_tensors, read_manifest
from pipetrain.data import load_tokenizer
from pipetrain.data.order import WindowOrder
from pipetrain.generate import choose_token
from pipetrain.hf.config import model_config_from_hf
from pipetrain.hf.export import lora_checkpoint_model
from pipetrain.hf.peft_export import export_peft
from pipetrain.hf.weights import load_hf_weights
from pipetrain.models import build, materialize
from pipetrain.models.lora import is_adapter, merge_lora
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.tensor.lora import apply_lora
from pipetrain.sft import encode_record
from tests.harness import HF_FP32, SMALL, hf_configs, save_tiny_hf, tokens
from tests.unit.common import LLAMA, build_trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "pipetrain", "assets", "tokenizer")
LORA = dataclasses.replace(LLAMA, lora_rank=4, lora_alpha=8.0)


def _lora_model(cfg, seed: int = 0):
    model = materialize(build(cfg, device="meta"), cfg, seed, "cpu")
    apply_lora(model, cfg, ParallelDims(), seed)
    with torch.no_grad():  # B = 0 at init: make the adapters matter
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(n)))
    return model


def _load_hf(hf_dir: str):
    cfg = model_config_from_hf(hf_dir)
    return load_hf_weights(build(cfg), hf_dir, cfg).eval()


def _rewrite_config(hf_dir: str, drop=(), **set_keys) -> None:
    path = os.path.join(hf_dir, "config.json")
    with open(path) as f:
        raw = json.load(f)
    for key in drop:
        raw.pop(key, None)
    raw.update(set_keys)
    with open(path, "w") as f:
        json.dump(raw, f)


# ---- LoRA (models/lora.py) ----

def test_lora_dropout_is_off_in_eval_mode_and_on_in_training():
    model = _lora_model(dataclasses.replace(LORA, lora_dropout=0.5))
    merged = merge_lora(copy.deepcopy(model))  # base + (alpha / r) B A, no dropout anywhere
    ids = tokens()
    with torch.no_grad():
        model.eval()
        torch.testing.assert_close(model(ids), merged(ids), rtol=1e-5, atol=1e-5)
        model.train()
        assert not torch.allclose(model(ids), merged(ids), rtol=1e-3, atol=1e-3)


def test_lora_a_is_drawn_with_pefts_bound_and_per_projection():
    """lora_A ~ U(+-1/sqrt(D_in)) (PEFT's kaiming_uniform(a=sqrt(5))), each from (seed, its global name)."""
    model = _lora_model(LORA)
    a = {n: p.detach() for n, p in model.named_parameters() if n.endswith("lora_A")}
    for name, t in a.items():
        bound = 1.0 / math.sqrt(t.shape[1])
        assert float(t.abs().max()) <= bound and float(t.abs().max()) > 0.8 * bound, name
    same_shape = [a["layers.0.attn.wq.lora_A"], a["layers.1.attn.wq.lora_A"], a["layers.0.attn.wo.lora_A"],
                  a["layers.0.mlp.gate.lora_A"]]  # all (r, D)
    for i in range(len(same_shape)):
        for j in range(i):
            assert not torch.equal(same_shape[i], same_shape[j]), (i, j)


@pytest.fixture(scope="module")
def square_lora_checkpoint(tmp_path_factory):
    """A one-step LoRA checkpoint with lora_rank == d_model (wq's A and B are square) and its adapters."""
    cfg = dataclasses.replace(LLAMA, lora_rank=LLAMA.d_model, lora_alpha=16.0)
    trainer = build_trainer(cfg, str(tmp_path_factory.mktemp("lora_ckpt")), steps=2, learnable=True, lr=5e-2)
    trainer.train_step()
    adapters = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if is_adapter(n)}
    return trainer.checkpointer.save(trainer), adapters


def test_a_lora_checkpoint_reads_back_its_own_adapters(square_lora_checkpoint):
    """What the merged export and generation merge: the saved adapters as trained, square ones included."""
    ckpt, adapters = square_lora_checkpoint
    model = lora_checkpoint_model(ckpt, read_manifest(ckpt))
    got = {n: p.detach() for n, p in model.named_parameters() if is_adapter(n)}
    assert got.keys() == adapters.keys()
    for name, want in adapters.items():
        assert torch.equal(got[name], want), name


def test_peft_export_writes_the_dtype_it_is_asked_for(square_lora_checkpoint, tmp_path):
    ckpt, _ = square_lora_checkpoint
    export_peft(ckpt, str(tmp_path / "bf16"), torch.bfloat16)
    got = load_file(str(tmp_path / "bf16" / "adapter_model.safetensors"))
    saved = dict(iter_full_tensors(ckpt))
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    assert {t.dtype for t in got.values()} == {torch.bfloat16}
    assert torch.equal(got[name], saved["layers.0.attn.wq.lora_B"].bfloat16())


# ---- import (hf/config.py, hf/weights.py) ----

def test_a_config_json_without_default_keys_reads_transformers_defaults(tmp_path):
    """transformers' LlamaConfig: untied and num_key_value_heads = num_attention_heads when the keys are absent."""
    import transformers as tf  # deferred: heavy, and only these import tests need it

    hf_dir = str(tmp_path / "llama")
    save_tiny_hf(tf.LlamaConfig(num_key_value_heads=SMALL["num_attention_heads"], tie_word_embeddings=False,
                                **SMALL), hf_dir, seed=2)
    _rewrite_config(hf_dir, drop=("tie_word_embeddings", "num_key_value_heads"))
    hf_model = tf.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(_load_hf(hf_dir)(x), hf_model(x).logits, **HF_FP32)


@pytest.mark.parametrize("layer_types", [True, False])  # transformers 5 writes layer_types; 4.x configs lack it
def test_qwen2_sliding_window_above_every_layer_is_full_attention(tmp_path, layer_types):
    """use_sliding_window with max_window_layers >= num_hidden_layers: no layer slides in transformers."""
    import transformers as tf  # deferred: heavy, and only these import tests need it

    hf_dir = str(tmp_path / "qwen2")
    config = tf.Qwen2Config(num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
                            max_window_layers=SMALL["num_hidden_layers"], **SMALL)
    hf_model = save_tiny_hf(config, hf_dir, seed=3)
    if not layer_types:
        _rewrite_config(hf_dir, drop=("layer_types",))
    x = tokens()  # T = 16 > the window of 4
    with torch.no_grad():
        torch.testing.assert_close(_load_hf(hf_dir)(x), hf_model(x).logits, **HF_FP32)
        reloaded = tf.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
        torch.testing.assert_close(reloaded(x).logits, hf_model(x).logits, **HF_FP32)


def test_gpt2_weights_named_without_the_transformer_prefix_load(tmp_path):
    """openai-community/gpt2's model.safetensors names h.0.attn.c_attn.weight, wte.weight, ... (the base model's
    names); transformers loads them into GPT2LMHeadModel, and so does pipetrain."""
    hf_dir = str(tmp_path / "gpt2")
    hf_model = save_tiny_hf(hf_configs()["gpt2"], hf_dir, seed=5)
    path = os.path.join(hf_dir, "model.safetensors")
    state = load_file(path)
    save_file({k.removeprefix("transformer."): v for k, v in state.items() if k != "lm_head.weight"}, path,
              metadata={"format": "pt"})
    from transformers import AutoModelForCausalLM  # deferred: heavy, and only these import tests need it

    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(hf_dir).eval()(x).logits,
                                   hf_model(x).logits, **HF_FP32)  # the renamed file is one transformers reads
        torch.testing.assert_close(_load_hf(hf_dir)(x), hf_model(x).logits, **HF_FP32)


# ---- sampling (generate/decode.py) ----

def test_top_p_takes_the_nucleus_of_the_tempered_distribution():
    """As transformers (temperature warper, then top-p): at temperature 2 the logits [0, 2, 1.8, -3] give
    p = [.156, .425, .384, .035], whose 0.9-nucleus is {1, 2, 0}; untempered it would be {1, 2}."""
    logits = torch.tensor([0.0, 2.0, 1.8, -3.0])
    probs = torch.softmax(logits / 2.0, dim=-1)
    assert probs[[1, 2]].sum() < 0.9 < probs[[1, 2, 0]].sum()  # the hand computation above
    picks = {choose_token(logits, 2.0, top_p=0.9, generator=torch.Generator().manual_seed(s)) for s in range(200)}
    assert picks == {0, 1, 2}


# ---- SFT (sft.py) ----

def test_a_template_ending_the_conversation_with_eos_gets_no_second_eos():
    tok = load_tokenizer(TOKENIZER)
    tok.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>", "<|end|>"]})
    eos = tok.eos_token
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
                         "{% if m['role'] == 'assistant' %}" + eos + "{% else %}<|end|>\n{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    chat = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris"},
            {"role": "user", "content": "And Italy?"}, {"role": "assistant", "content": "Rome"}]
    ids, mask = encode_record({"messages": chat}, tok)
    assert tok.decode(ids) == tok.apply_chat_template(chat, tokenize=False)
    assert ids.count(tok.eos_token_id) == 2 and ids[-1] == tok.eos_token_id and mask[-1]
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == f"Paris{eos}Rome{eos}"


# ---- sample order (data/order.py) ----

def test_window_order_of_a_power_of_two_count_matches_its_golden_values():
    """n = 16: a 16-value domain, no cycle walking (a resumed run re-derives its windows from these)."""
    order = WindowOrder(16, 7)
    assert order(0, np.arange(16)).tolist() == [11, 14, 4, 10, 5, 12, 1, 8, 0, 7, 13, 15, 9, 2, 6, 3]
    assert order(1, np.arange(16)).tolist() == [13, 14, 3, 6, 12, 5, 2, 7, 10, 9, 15, 11, 0, 8, 4, 1]
