"""Recipe range checks at their boundaries: tests/unit/test_config.py tries values far outside each range
(beta 2.0, seed 2**64, eval_batches -1), so a check moved by one (beta 1 allowed, eval_batches 0 allowed, seed
2**63 allowed, lora_rank = d_model refused) passed it."""
import pytest

from pipetrain.config import ConfigError, build_recipe
from tests.unit.test_config import _with


@pytest.mark.parametrize("section, key, value, message", [
    ("train", "beta1", 1.0, r"train.beta1=1.0 must be in \[0, 1\)"),  # AdamW's bias correction divides by 0
    ("train", "beta2", 1.0, r"train.beta2=1.0 must be in \[0, 1\)"),
    ("run", "eval_batches", 0, r"run.eval_batches=0 must be >= 1"),
    ("train", "seed", 2 ** 63, r"train.seed=9223372036854775808 must be in \[0, 2\*\*63\)"),
    ("data", "seed", 2 ** 63, r"data.seed=9223372036854775808 must be in \[0, 2\*\*63\)"),
    ("model", "lora_rank", 65, r"model.lora_rank=65 must be <= model.d_model=64"),
    ("train", "steps", 2 ** 63, r"train.steps=9223372036854775808 must be below 2\*\*63"),
    ("train", "steps", int("9" * 400), r"train.steps=9999.*more characters\) must be below 2\*\*63"),
])
def test_the_first_value_past_each_bound_is_refused(section, key, value, message):
    with pytest.raises(ConfigError, match=message):
        build_recipe(_with(**{section: {key: value}}))


@pytest.mark.parametrize("section, key, value", [
    ("train", "beta1", 0.0), ("train", "beta2", 0.999999), ("run", "eval_batches", 1),
    ("train", "seed", 2 ** 63 - 1), ("data", "seed", 0), ("model", "lora_rank", 64),
    ("train", "steps", 2 ** 63 - 1),
])
def test_the_last_value_inside_each_bound_is_accepted(section, key, value):
    recipe = build_recipe(_with(**{section: {key: value}}))
    assert getattr(getattr(recipe, section), key) == value
