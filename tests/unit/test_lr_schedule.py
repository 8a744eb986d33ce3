"""train.lr_schedule: each schedule's value at its key steps (warmup, phase boundaries, the end)."""
import math

import pytest

from pipetrain.config import ConfigError, TrainConfig, build_recipe
from pipetrain.lr_schedule import decay_start, lr_at
from pipetrain.optim.build import lr_at as optim_lr_at

BASE = dict(steps=100, lr=1.0, min_lr=0.1, warmup_steps=10)


def cfg(schedule: str, **kw) -> TrainConfig:
    return TrainConfig(**{**BASE, "lr_schedule": schedule, **kw})


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
def test_every_schedule_warms_up_linearly_to_lr(schedule):
    c = cfg(schedule)
    assert [lr_at(s, c) for s in (1, 5, 10)] == pytest.approx([0.1, 0.5, 1.0])


def test_cosine_is_half_way_at_the_midpoint_and_min_lr_at_the_end():
    c = cfg("cosine")
    assert lr_at(55, c) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(100, c) == pytest.approx(0.1) and lr_at(150, c) == pytest.approx(0.1)
    assert lr_at(11, c) < 1.0 and lr_at(11, c) > lr_at(12, c)


def test_cosine_is_the_default_and_optim_forwards_to_it():
    c = TrainConfig(**BASE)
    assert c.lr_schedule == "cosine"
    assert [optim_lr_at(s, c) for s in range(1, 101)] == [lr_at(s, cfg("cosine")) for s in range(1, 101)]


def test_linear_falls_in_a_straight_line_to_min_lr():
    c = cfg("linear")
    assert lr_at(55, c) == pytest.approx(0.55)
    assert lr_at(100, c) == pytest.approx(0.1)
    assert lr_at(32.5, c) - lr_at(55, c) == pytest.approx(lr_at(55, c) - lr_at(77.5, c))


def test_constant_holds_lr_after_warmup():
    c = cfg("constant")
    assert {lr_at(s, c) for s in range(10, 101)} == {1.0}


def test_wsd_is_stable_then_decays_over_the_last_fraction():
    c = cfg("wsd", decay_fraction=0.2)  # decay over steps 81..100
    assert {lr_at(s, c) for s in range(10, 81)} == {1.0}
    assert lr_at(90, c) == pytest.approx(0.55)
    assert lr_at(100, c) == pytest.approx(0.1)
    assert lr_at(81, c) < 1.0


def test_wsd_decay_length_rounds_to_the_nearest_step():
    """decay_fraction x steps rounded to the nearest step (the docstring's contract; torchtitan's too):
    0.25 x 30 = 7.5 -> 8 decay steps (halves to even), 0.27 x 30 = 8.1 -> 8, 0.29 x 30 = 8.7 -> 9."""
    for fraction, decay in ((0.25, 8), (0.27, 8), (0.29, 9)):
        c = cfg("wsd", steps=30, decay_fraction=fraction)
        assert decay_start(c) == 30 - decay
        assert lr_at(30 - decay, c) == 1.0 and lr_at(31 - decay, c) < 1.0


def test_wsd_decay_longer_than_the_run_starts_after_warmup():
    c = cfg("wsd", decay_fraction=1.0)
    assert lr_at(10, c) == pytest.approx(1.0)
    assert [lr_at(s, c) for s in range(10, 101)] == pytest.approx([lr_at(s, cfg("linear")) for s in range(10, 101)])


def test_no_warmup_starts_at_full_lr():
    assert lr_at(1, cfg("constant", warmup_steps=0)) == 1.0
    assert lr_at(1, cfg("cosine", warmup_steps=0, steps=1)) == pytest.approx(0.1)


def test_lr_zero_is_valid_and_stays_zero():
    recipe = build_recipe({"train": {"lr": 0, "min_lr": 0}, "data": {"path": "x", "tokenizer": "y"}})
    assert recipe.train.lr == 0.0
    assert {lr_at(s, recipe.train) for s in range(1, recipe.train.steps + 1)} == {0.0}


def test_bad_schedule_and_decay_fraction_are_one_error():
    with pytest.raises(ConfigError) as exc:
        build_recipe({"train": {"lr_schedule": "step", "decay_fraction": 1.5}})
    assert "train.lr_schedule='step' is not one of cosine, linear, constant, wsd" in str(exc.value)
    with pytest.raises(ConfigError, match=r"train.decay_fraction=1.5 must be in \[0, 1\]"):
        build_recipe({"train": {"lr_schedule": "wsd", "decay_fraction": 1.5}, "data": {"path": "x", "tokenizer": "y"}})
    with pytest.raises(ConfigError, match="train.lr=-1.0 must be >= 0"):
        build_recipe({"train": {"lr": -1}, "data": {"path": "x", "tokenizer": "y"}})
