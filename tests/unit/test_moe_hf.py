"""Hugging Face import and export of the mixture-of-experts families (mixtral, qwen3_moe) against
transformers itself, on tiny random models: both expert layouts transformers has used, the refusals,
and a gating order that differs from HF's failing parity."""
import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from pipetrain.config import ConfigError, ModelConfig
from pipetrain.hf.config import model_config_from_hf
from pipetrain.hf.export import export_model
from pipetrain.hf.weights import PER_EXPERT, MOE_BLOCK, load_hf_weights
from pipetrain.models import build
from pipetrain.models.moe import MoE
from tests.harness import HF_FP32, moe_hf_configs, save_tiny_hf, tokens
from tests.unit.test_hf import random_model

FAMILIES = ("mixtral", "qwen3_moe")


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    """{family: (dir, transformers model)} with the experts fused as transformers 5 holds them in memory
    (mlp.experts.gate_up_proj (E, 2F, D), down_proj (E, D, F)). save_pretrained itself writes the 4.x
    per-expert names back, so the fused file is written from the in-memory state dict."""
    root = tmp_path_factory.mktemp("hf_moe")
    out = {}
    for name, cfg in moe_hf_configs().items():
        model = save_tiny_hf(cfg, str(root / name))
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
        save_file(state, str(root / name / "model.safetensors"), metadata={"format": "pt"})
        out[name] = (str(root / name), model)
    return out


def _load(hf_dir: str):
    cfg = model_config_from_hf(hf_dir)
    return load_hf_weights(build(cfg), hf_dir, cfg).eval(), cfg


def _hf_logits(hf_model):
    with torch.no_grad():
        return hf_model(tokens()).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_imported_moe_gives_transformers_logits(hf_moe, family):
    hf_dir, hf_model = hf_moe[family]
    model, cfg = _load(hf_dir)
    assert cfg.family == family and cfg.num_experts == 4 and cfg.num_experts_per_tok == 2
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), _hf_logits(hf_model), **HF_FP32)


def _per_expert_copy(src_dir: str, dst_dir, family: str) -> str:
    """src_dir re-saved in transformers 4.x's per-expert layout: the fused tensors split by expert."""
    os.makedirs(dst_dir)
    state = load_file(os.path.join(src_dir, "model.safetensors"))
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    out = {}
    names = PER_EXPERT[family]
    for name, t in state.items():
        layer, _, leaf = name.partition(".mlp.")
        block = f"{layer}.{MOE_BLOCK[family]}"
        if leaf == "experts.gate_up_proj":
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{block}.experts.{e}.{names['gate']}.weight"] = gate[e].contiguous()
                out[f"{block}.experts.{e}.{names['up']}.weight"] = up[e].contiguous()
        elif leaf == "experts.down_proj":
            for e in range(t.shape[0]):
                out[f"{block}.experts.{e}.{names['down']}.weight"] = t[e].contiguous()
        elif leaf == "gate.weight":
            out[f"{block}.gate.weight"] = t
        else:
            out[name] = t
    save_file(out, os.path.join(dst_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src_dir, "config.json")) as f:
        raw = json.load(f)
    if family == "qwen3_moe":  # 4.x wrote num_experts
        raw["num_experts"] = raw.pop("num_local_experts")
    with open(os.path.join(dst_dir, "config.json"), "w") as f:
        json.dump(raw, f)
    return str(dst_dir)


@pytest.mark.parametrize("family", FAMILIES)
def test_per_expert_layout_of_transformers_4_imports_to_the_same_logits(hf_moe, tmp_path, family):
    hf_dir, hf_model = hf_moe[family]
    old = _per_expert_copy(hf_dir, tmp_path / "v4", family)
    names = list(load_file(os.path.join(old, "model.safetensors")))
    assert not any("gate_up_proj" in k for k in names)
    assert f"model.layers.1.{MOE_BLOCK[family]}.experts.3.{PER_EXPERT[family]['down']}.weight" in names
    model, _ = _load(old)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), _hf_logits(hf_model), **HF_FP32)


EXPORT_CASES = {
    "mixtral": ModelConfig(family="mixtral", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                           max_seq_len=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24),
    "qwen3_moe": ModelConfig(family="qwen3_moe", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                             max_seq_len=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                             head_dim_=12, norm_topk_prob=True),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_moe_gives_pipetrain_logits_in_transformers(tmp_path, family):
    from transformers import AutoModelForCausalLM

    cfg = EXPORT_CASES[family]
    model = random_model(cfg)
    export_model(model, cfg, str(tmp_path))
    hf_model = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tokens()).logits, model(tokens()), **HF_FP32)
    back = model_config_from_hf(str(tmp_path))
    assert (back.num_experts, back.expert_ffn, back.norm_topk, back.head_dim) == \
        (cfg.num_experts, cfg.expert_ffn, cfg.norm_topk, cfg.head_dim)


def test_export_refuses_what_no_hf_moe_class_holds(tmp_path):
    cfg = ModelConfig(**{**EXPORT_CASES["mixtral"].__dict__, "shared_expert_intermediate_size": 16})
    with pytest.raises(ConfigError, match=r"^export: mixtral has no shared expert.*got shared_expert_intermediate_size=16"):
        export_model(random_model(cfg), cfg, str(tmp_path / "a"))


def _with_config(src: str, dst, **changes) -> str:
    os.makedirs(dst)
    shutil.copy(os.path.join(src, "model.safetensors"), os.path.join(dst, "model.safetensors"))  # a link would lead out
    with open(os.path.join(src, "config.json")) as f:
        raw = json.load(f)
    raw.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(raw, f)
    return str(dst)


@pytest.mark.parametrize("family,changes,pattern", [
    ("qwen3_moe", dict(mlp_only_layers=[1]), r"mlp_only_layers \(dense layers among the sparse ones\) is not supported, got \[1\]"),
    ("qwen3_moe", dict(decoder_sparse_step=2), r"decoder_sparse_step != 1 .* is not supported, got 2"),
    ("mixtral", dict(router_jitter_noise=0.1), r"router_jitter_noise is not supported, got 0.1"),
])
def test_unsupported_moe_config_is_rejected_by_name(hf_moe, tmp_path, family, changes, pattern):
    with pytest.raises(ConfigError, match=pattern):
        model_config_from_hf(_with_config(hf_moe[family][0], tmp_path / "m", **changes))


def test_a_gating_order_other_than_hf_fails_parity(hf_moe, monkeypatch):
    """top-k of the logits and then a softmax over those k (renormalising) is not qwen3_moe's order
    (softmax over all experts, top-k, no renormalisation): the parity check must see the difference."""
    hf_dir, hf_model = hf_moe["qwen3_moe"]
    model, _ = _load(hf_dir)

    def topk_then_softmax(self, x):
        logits = self.router(x).reshape(-1, self.num_experts).float()
        top = logits.topk(self.top_k, dim=-1)
        probs = F.softmax(logits, dim=-1).view(*x.shape[:2], -1)
        return top.indices, F.softmax(top.values, dim=-1).to(x.dtype), (probs, top.indices)

    monkeypatch.setattr(MoE, "route", topk_then_softmax)
    with torch.no_grad():
        broken = model(tokens())
    with pytest.raises(AssertionError):
        torch.testing.assert_close(broken, _hf_logits(hf_model), **HF_FP32)


def test_export_refuses_a_trained_router_bias_and_writes_nothing(tmp_path):
    """The aux-loss-free bias changes which experts a token goes to; transformers' mixtral has no place for
    it, so an export that dropped it would route differently: refused in one line, before any file."""
    cfg = EXPORT_CASES["mixtral"]
    model = random_model(cfg)
    export_model(model, cfg, str(tmp_path / "zero"))  # an untrained (zero) bias exports
    with torch.no_grad():
        model.layers["1"].mlp.router.expert_bias[2] = 1e-3
    with pytest.raises(ConfigError, match=r"^export: layers\.1\.mlp\.router\.expert_bias is nonzero .*"
                                          r"router_bias_update_rate=0 to export"):
        export_model(model, cfg, str(tmp_path / "biased"))
    assert not os.path.exists(tmp_path / "biased")
