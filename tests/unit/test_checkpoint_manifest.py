"""What a checkpoint's manifest records about the run: the LR schedule it was saved under."""

import numpy as np
import pytest

from pipetrain.build import build_trainer
from pipetrain.checkpoint.load import check_compatible
from pipetrain.checkpoint.read import read_manifest
from pipetrain.config import ConfigError, ModelConfig, ParallelConfig, Recipe, RunConfig, TrainConfig
from pipetrain.data import Loader, PackedData
from tests.unit.common import LLAMA


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
def test_manifest_records_the_runs_lr_schedule(tmp_path, schedule):
    recipe = Recipe(model=LLAMA, parallel=ParallelConfig(),
                    train=TrainConfig(steps=4, global_batch=4, seq_len=16, warmup_steps=2, lr_schedule=schedule),
                    run=RunConfig(output_dir=str(tmp_path), progress=False))
    tokens = np.random.default_rng(0).integers(0, LLAMA.vocab_size, 64 * 17).astype(np.int32)
    trainer = build_trainer(recipe, loader=Loader(PackedData(tokens, None, 16, 0.0, 2), 4, 0, 1))
    trainer.train_step()
    manifest = read_manifest(trainer.checkpointer.save(trainer))
    assert manifest["lr_schedule"] == {"step": 1, "name": schedule, "warmup_steps": 2}


def test_a_checkpoint_of_another_expert_count_is_refused_by_name():
    """num_experts (and the shared expert's width) are compared by name: fewer experts in the recipe would read
    the first of the saved ones (a box of the saved tensors) where the refusal names the key and both values."""
    saved = Recipe(model=ModelConfig(family="mixtral", num_experts=8)).to_dict()
    for key, value in (("num_experts", 4), ("shared_expert_intermediate_size", 64)):
        recipe = Recipe(model=ModelConfig(family="mixtral", **{"num_experts": 8, key: value}))
        with pytest.raises(ConfigError, match=f"model.{key}: checkpoint .* vs recipe {value}"):
            check_compatible({"recipe": saved}, recipe, "ckpt")
    check_compatible({"recipe": saved}, Recipe(model=ModelConfig(family="mixtral", num_experts=8)), "ckpt")
