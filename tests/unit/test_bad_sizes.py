"""Bad sizes and world sizes are refused by arithmetic, before anything is built, with one line.

A build of a million-layer model on the meta device took minutes (train, --dry-run and plan all did it
to count parameters); each case here runs with the model constructor replaced by one that fails, so a
check that builds anything fails the test instead of only being slow. Recipes that expand YAML aliases
past the stated limits are refused before any Python object is built."""
from __future__ import annotations

import os

import pytest

from pipetrain import cli
from pipetrain.config import ConfigError, ModelConfig, load_recipe
from pipetrain.config.loading import MAX_RECIPE_DEPTH
from pipetrain.models import build, count_params
from pipetrain.models import decoder as decoder_module
from pipetrain.plan.__main__ import main as plan_main
from pipetrain.plan.shapes import model_params

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "recipes", "tiny.yaml")


@pytest.fixture
def nothing_is_built(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a size check built the model")

    monkeypatch.setattr(decoder_module.Decoder, "__init__", refuse)


def _one_error(capsys, code: int) -> str:
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gpt2"])
@pytest.mark.parametrize("tied", [False, True])
def test_arithmetic_parameter_count_equals_a_built_model(family, tied):
    m = ModelConfig(family=family, vocab_size=100, d_model=32, n_layers=3, n_heads=4,
                    n_kv_heads=4 if family == "gpt2" else 2, ffn_hidden=48, max_seq_len=16, tie_embeddings=tied)
    assert model_params(m) == count_params(build(m, device="meta"))


@pytest.mark.parametrize("extra", [["--dry-run"], []], ids=["dry-run", "train"])
def test_a_million_layers_is_refused_without_building(nothing_is_built, capsys, tmp_path, extra):
    line = _one_error(capsys, cli.main(["--recipe", TINY, "--set", "model.n_layers=1000000",
                                        "--set", f"run.output_dir={tmp_path}"] + extra))
    assert "model.n_layers=1000000" in line and "per rank" in line


def test_a_dry_run_of_a_model_that_cannot_fit_is_refused(nothing_is_built, capsys, tmp_path):
    line = _one_error(capsys, cli.main(["--recipe", TINY, "--set", "model.d_model=10000000", "--set",
                                        f"run.output_dir={tmp_path}", "--dry-run", "--nproc", "2"]))
    assert "GB per rank" in line and "shrink the model" in line


@pytest.mark.parametrize("nproc", ["0", "-3"])
def test_dry_run_nproc_below_one_is_refused(capsys, tmp_path, nproc):
    line = _one_error(capsys, cli.main(["--recipe", TINY, "--set", f"run.output_dir={tmp_path}",
                                        "--dry-run", "--nproc", nproc]))
    assert f"--nproc={nproc}" in line and ">= 1" in line


def test_plan_names_the_world_size_and_the_model_size(nothing_is_built, capsys):
    line = _one_error(capsys, plan_main(["--recipe", TINY, "--nproc", "1000000"]))
    assert "world size 1000000 exceeds" in line and "train.global_batch" in line
    line = _one_error(capsys, plan_main(["--recipe", TINY, "--nproc", "2", "--set", "model.n_layers=1000000"]))
    assert "even spread over all 2 ranks" in line


@pytest.mark.parametrize("keys, reason", [
    (["--recipe", "moe-tiny", "--set", "parallel.cp=2", "--set", "parallel.ep=2"], "parallel.ep: must divide dp=1"),
    (["--recipe", TINY, "--set", "parallel.cp=4"], "world size 2 is not divisible by"),
], ids=["ep-with-cp-over-the-whole-world", "cp-does-not-divide"])
def test_plan_names_the_rule_that_refused_every_layout_not_memory(nothing_is_built, capsys, keys, reason):
    """Where every layout breaks a rule, plan says which (exit 2, as the dry run does), where it said no layout
    fits in memory (exit 1) and advised a shorter sequence."""
    line = _one_error(capsys, plan_main(keys + ["--nproc", "2"]))
    assert reason in line and "no layout of 2 processes" in line and "GiB" not in line, line


def _bomb(levels: int) -> str:
    lines = ["run:", "  trackers:", '    a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for i in range(1, levels):
        prev, name = chr(ord("a") + i - 1), chr(ord("a") + i)
        lines.append(f"    {name}: &{name} [{', '.join(['*' + prev] * 9)}]")
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(_bomb(9))  # 9^9 = 387 million strings once expanded
    with pytest.raises(ConfigError, match="expands past 100000 nodes"):
        load_recipe(str(path))


def test_deep_nesting_and_huge_files_are_refused(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("run:\n  trackers: " + "[" * (MAX_RECIPE_DEPTH + 2) + "]" * (MAX_RECIPE_DEPTH + 2) + "\n")
    with pytest.raises(ConfigError, match="levels"):
        load_recipe(str(deep))
    huge = tmp_path / "huge.yaml"
    huge.write_text("# " + "x" * (1 << 20) + "\n")
    with pytest.raises(ConfigError, match="over the 1048576 limit"):
        load_recipe(str(huge))


def test_a_small_alias_is_still_fine_and_long_values_are_clipped_in_messages(tmp_path):
    ok = tmp_path / "ok.yaml"
    ok.write_text(_bomb(2).replace("trackers:\n", "trackers_list:\n"))  # (tiny's own run: section would be a duplicate)
    with pytest.raises(ConfigError) as info:  # an unknown key, quoted in the message, is short
        load_recipe(str(ok))
    assert "unknown key 'run.trackers_list'" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_recipe(TINY, ["train.precision=" + "y" * 50_000])
    assert "more characters" in str(info.value) and len(str(info.value)) < 2000


@pytest.mark.parametrize("weight", [".inf", ".nan", "-1", "0"])
def test_a_source_weight_must_be_positive_and_finite(weight):
    corpus = os.path.join(ROOT, "pipetrain", "assets", "shakespeare")
    with pytest.raises(ConfigError, match=r"data.sources\[0\].weight=.* must be a positive finite number"):
        load_recipe(TINY, ["data.path=", f"data.sources=[{{path: {corpus}, weight: {weight}}}]"])
