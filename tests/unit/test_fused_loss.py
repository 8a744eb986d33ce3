"""train.fused_loss in one process: the run's losses and weights match the unfused loss step by step
(untied and tied heads, LoRA, bf16), the (B, T, V) logits are never built, and "auto" resolves by device.
The layouts (tp 2, sequence parallel, pp 2 with a tied head, split backward) are in tests/dist/test_fused_loss.py."""
from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pipetrain.config import ConfigError, build_recipe, fused_loss_on, schema
from tests.harness import EXACT_FP32
from tests.unit.common import BF16_LOSS, GPT2, LLAMA, build_trainer
from tests.unit.test_moe import MOE

MODEL = {"d_model": 64, "n_layers": 2, "n_heads": 4}
DATA = {"path": "x", "tokenizer": "y"}

STEPS = 3
LORA = dataclasses.replace(LLAMA, lora_rank=4, lora_alpha=8.0)
LCE = importlib.import_module("pipetrain.kernels.linear_cross_entropy")
# Weights after AdamW steps: Adam divides by sqrt(v), so the fp32 round-off of a small gradient (the
# chunked dW sums in another order) moves its update by lr x that relative error, not by round-off.
ADAM_FP32 = dict(rtol=1e-4, atol=1e-5)


def _train(cfg, out, fused, **kw):
    out.mkdir()
    trainer = build_trainer(cfg, str(out), fused_loss=fused, steps=STEPS, microbatches=2, **kw)
    records = [trainer.train_step() for _ in range(STEPS)]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return [r["loss"] for r in records], [r["grad_norm"] for r in records], params


@pytest.mark.parametrize("cfg, ignore_every", [(LLAMA, 0), (GPT2, 0), (LORA, 0), (LLAMA, 3), (MOE, 0)],
                         ids=["llama", "gpt2-tied", "llama-lora", "llama-a-third-of-the-targets-ignored",
                              "mixtral-experts"])
def test_fused_loss_matches_the_unfused_run_at_every_step(tmp_path, cfg, ignore_every, monkeypatch):
    """ignore_every 3: a loss mask (as SFT's) leaves a third of the targets untrained: the mean is over the others.
    mixtral: the routers' aux loss reaches them through the experts' backward, whichever loss the head feeds."""
    monkeypatch.setattr(LCE, "MIN_CHUNK_ROWS", 1)  # several chunks per microbatch (22 rows of 64)
    want_losses, want_norms, want_params = _train(cfg, tmp_path / "unfused", False, ignore_every=ignore_every)
    got_losses, got_norms, got_params = _train(cfg, tmp_path / "fused", True, ignore_every=ignore_every)
    assert want_losses[-1] != want_losses[0]
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), **EXACT_FP32)
    torch.testing.assert_close(torch.tensor(got_norms), torch.tensor(want_norms), **EXACT_FP32)
    # the head's weight (gpt2: the tied embedding, so its gradient reached the shared parameter); LoRA:
    # the frozen head and base stay bitwise where they were
    for name in {"embed.weight", "head.weight"} & set(want_params):  # named_parameters lists a tied one once
        torch.testing.assert_close(got_params[name], want_params[name], **ADAM_FP32, msg=lambda m: f"{name}: {m}")
    if cfg.lora_rank:
        assert torch.equal(got_params["head.weight"], want_params["head.weight"])


def test_fused_loss_under_bf16_autocast_runs_the_heads_gemms_in_bf16_as_the_unfused_run(tmp_path, monkeypatch):
    """The fused loss runs under the chunks' autocast, so its GEMMs take bf16 operands as the unfused head's F.linear
    does: the first step's loss (bf16 logits of the same bf16 operands) equals the unfused one to fp32 round-off, and
    the run stays near it. Outside autocast they ran in fp32: 1.2x the step time on an H100 (docs/benchmarks.md)."""
    seen, apply = [], LCE.LinearCrossEntropyFn.apply
    monkeypatch.setattr(LCE.LinearCrossEntropyFn, "apply",
                        lambda hidden, weight, *rest: seen.append((hidden.dtype, weight.dtype)) or apply(hidden, weight,
                                                                                                          *rest))
    want = _train(LLAMA, tmp_path / "unfused", False, precision="bf16")[0]
    assert not seen
    got = _train(LLAMA, tmp_path / "fused", True, precision="bf16")[0]
    assert set(seen) == {(torch.bfloat16, torch.bfloat16)}, set(seen)
    assert got[0] == pytest.approx(want[0], rel=1e-6, abs=0)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **BF16_LOSS)


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor an op creates."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        return out


@pytest.mark.parametrize("fused", [False, True])
def test_fused_loss_never_builds_the_whole_logits(tmp_path, monkeypatch, fused):
    monkeypatch.setattr(LCE, "MIN_CHUNK_ROWS", 1)
    cfg = dataclasses.replace(LLAMA, vocab_size=96)  # no other dim is 96
    trainer = build_trainer(cfg, str(tmp_path), fused_loss=fused, microbatches=2)
    with _Shapes() as mode:
        trainer.train_step()
    tokens = 8 // 2 * 16  # sequences per microbatch x seq_len
    whole = [s for s in mode.shapes if s and s[-1] == 96 and torch.Size(s).numel() >= tokens * 96]
    if fused:
        assert not whole, f"(tokens, V) logits were built: {whole[:3]}"
        assert any(len(s) == 2 and s[1] == 96 and s[0] < tokens for s in mode.shapes), "no (C, V) chunk ran"
    else:
        assert (4, 16, 96) in whole, sorted(set(mode.shapes))  # the meter sees the unfused head's logits


def test_fused_loss_auto_follows_the_measured_devices_and_vocabularies_and_the_key_takes_bools(monkeypatch):
    auto = build_recipe({"model": MODEL, "data": DATA})
    assert auto.train.fused_loss == "auto"
    assert not fused_loss_on(auto, "cuda") and not fused_loss_on(auto, "cpu")
    # as shipped: on CUDA from the vocabulary per tp rank an H200 measured it at least as fast (llama-3's 128,256)
    llama3 = build_recipe({"model": {**MODEL, "vocab_size": 128_256}, "data": DATA})
    assert fused_loss_on(llama3, "cuda") and not fused_loss_on(llama3, "cpu")
    llama3_tp2 = build_recipe({"model": {**MODEL, "vocab_size": 128_256}, "data": DATA, "parallel": {"tp": 2}})
    assert not fused_loss_on(llama3_tp2, "cuda")  # 64,128 a rank: not measured faster
    vocab = auto.model.vocab_size
    monkeypatch.setattr(schema, "FUSED_LOSS_FASTER_FROM_VOCAB", {"cuda": vocab})
    assert fused_loss_on(auto, "cuda") and not fused_loss_on(auto, "cpu")
    monkeypatch.setattr(schema, "FUSED_LOSS_FASTER_FROM_VOCAB", {"cuda": vocab + 1})
    assert not fused_loss_on(auto, "cuda")  # measured faster only from a larger vocabulary
    tp2 = build_recipe({"model": MODEL, "data": DATA, "parallel": {"tp": 2}})
    monkeypatch.setattr(schema, "FUSED_LOSS_FASTER_FROM_VOCAB", {"cuda": vocab // 2})
    assert fused_loss_on(tp2, "cuda") and fused_loss_on(auto, "cuda")
    monkeypatch.setattr(schema, "FUSED_LOSS_FASTER_FROM_VOCAB", {"cuda": vocab // 2 + 1})
    assert not fused_loss_on(tp2, "cuda")  # each tp rank holds vocab / tp of the head
    on = build_recipe({"model": MODEL, "data": DATA, "train": {"fused_loss": True}})
    assert fused_loss_on(on, "cpu")
    with pytest.raises(ConfigError, match="train.fused_loss='yes' is not one of"):
        build_recipe({"model": MODEL, "data": DATA, "train": {"fused_loss": "yes"}})
    # 1 == True in Python: matched by value alone, 1 passed as true past the rules that test `is True`
    for number in (1, 0, 1.0):
        with pytest.raises(ConfigError, match=f"train.fused_loss={number!r} is not one of auto, true, false"):
            build_recipe({"model": MODEL, "data": DATA, "train": {"fused_loss": number}})
