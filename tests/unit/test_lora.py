"""LoRA in one process: the base stays bitwise frozen (no gradient, no optimizer state), only the
adapters train, the adapted model starts as the base model, merging folds the adapters into the
base weights with the same logits, and bad LoRA keys are one-line errors."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipetrain.checkpoint.load import load as load_checkpoint
from pipetrain.checkpoint.read import read_manifest
from pipetrain.config import ConfigError, DataConfig, ModelConfig, Recipe, validate
from pipetrain.models import build, materialize
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.models.lora import count_trainable, is_adapter, merge_lora
from pipetrain.parallel.tensor.lora import apply_lora
from tests.unit.common import GPT2, LLAMA, build_trainer

LORA = dataclasses.replace(LLAMA, lora_rank=4, lora_alpha=8.0)


def _model(cfg: ModelConfig, seed: int = 0):
    model = materialize(build(cfg, device="meta"), cfg, seed, "cpu")
    apply_lora(model, cfg, ParallelDims(), seed)
    return model


def test_adapters_start_as_the_base_model_and_freeze_it():
    base = materialize(build(LORA, device="meta"), LORA, 0, "cpu")
    model = _model(LORA)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(ids), base(ids), rtol=0, atol=0)  # B = 0
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter(n) for n in trainable)
    # every attention and MLP projection of every layer: 2 layers x 7 projections x (A, B)
    assert len(trainable) == 2 * 7 * 2
    assert model.layers["0"].attn.wq.lora_A.shape == (4, 32) and model.layers["0"].attn.wq.lora_B.shape == (32, 4)
    assert model.layers["0"].attn.wk.lora_B.shape == (16, 4)  # 2 kv heads x head dim 8


def test_targets_select_projections():
    cfg = dataclasses.replace(LORA, lora_targets=["wq", "down"])
    model = _model(cfg)
    names = {n.split(".", 2)[2].rsplit(".", 1)[0] for n, p in model.named_parameters() if p.requires_grad}
    assert names == {"attn.wq", "mlp.down"}
    assert count_trainable(model) == 2 * (4 * 32 + 32 * 4 + 4 * 64 + 32 * 4)


def test_training_changes_only_adapters(tmp_path):
    trainer = build_trainer(LORA, str(tmp_path), steps=3, learnable=True)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    losses = [trainer.train_step()["loss"] for _ in range(3)]
    assert losses[-1] < losses[0]
    for n, p in trainer.model.named_parameters():
        if is_adapter(n):
            if n.endswith("lora_B"):
                assert not torch.equal(p, before[n]), n
        else:
            assert torch.equal(p, before[n]), f"{n}: the frozen base changed"
            assert p.grad is None
    # optimizer state only for the adapters
    state_names = {name.split("/", 1)[1] for name, *_ in trainer.optimizer.state_items() if "/" in name}
    assert state_names and all(is_adapter(n) for n in state_names)


def test_merge_gives_the_same_logits():
    model = _model(LORA)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    want = model(ids)
    merge_lora(model)
    assert not any(is_adapter(n) for n, _ in model.named_parameters())
    torch.testing.assert_close(model(ids), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cfg, needle", [
    (dataclasses.replace(LLAMA, lora_rank=0), "model.lora_rank=0 must be >= 1"),
    (dataclasses.replace(GPT2, lora_rank=4, lora_targets=["gate"]), "gpt2 has no projection 'gate'"),
    (dataclasses.replace(LLAMA, lora_rank=4, lora_targets=["q_proj"]), "llama has no projection 'q_proj'"),
    (dataclasses.replace(LLAMA, lora_targets=["wq"]), "model.lora_rank is not"),
    (dataclasses.replace(LLAMA, lora_rank=4, lora_dropout=1.0), "model.lora_dropout=1.0"),
    (dataclasses.replace(LLAMA, lora_rank=33), "model.lora_rank=33 must be <= model.d_model=32"),
    (dataclasses.replace(LLAMA, lora_rank=10 ** 20), f"model.lora_rank={10 ** 20} must be <= model.d_model=32"),
])
def test_bad_lora_keys(cfg, needle):
    recipe = Recipe(model=cfg, data=DataConfig(path="x", tokenizer="y"))
    problems = validate(recipe)
    assert any(needle in p for p in problems), problems


def test_checkpoint_holds_adapters_only_and_loads_only_into_lora(tmp_path):
    for d in "abc":
        (tmp_path / d).mkdir()
    trainer = build_trainer(LORA, str(tmp_path / "a"), steps=2, learnable=True)
    trainer.train_step()
    path = trainer.checkpointer.save(trainer)
    manifest = read_manifest(path)
    names = {n.split("/", 1)[1] for n in manifest["tensors"] if n.startswith("model/")}
    assert names == {n for n, _ in trainer.model.named_parameters() if is_adapter(n)}
    assert manifest["base"] == {"init_from": None, "seed": trainer.recipe.train.seed}
    fresh = build_trainer(LORA, str(tmp_path / "b"), steps=2, learnable=True)  # adapters back, base from the seed
    load_checkpoint(path, {"model": fresh.model, "optimizer": fresh.optimizer, "loader": fresh.loader},
                    fresh.recipe, fresh.dims)
    for (n, p), (_, q) in zip(trainer.model.named_parameters(), fresh.model.named_parameters()):
        assert torch.equal(p, q), n
    plain = build_trainer(LLAMA, str(tmp_path / "c"), steps=2)
    with pytest.raises(ConfigError, match="model.lora_rank: checkpoint 4 vs recipe None"):
        load_checkpoint(path, {"model": plain.model, "optimizer": plain.optimizer, "loader": plain.loader},
                        plain.recipe, plain.dims)
