"""pipetrain.parallel.mesh.rules: every rule on parallel keys, in one place. parallel_problems (no world size)
and layout_problems (every reason a dp x tp x pp layout cannot run on a world size) report all at once."""
import ast
import dataclasses
import pathlib
import re

import pytest

from pipetrain.config import ModelConfig, ParallelConfig, Recipe, TrainConfig, build_recipe
from pipetrain.parallel.mesh.rules import layout_problems, parallel_problems, pipeline_problems, tensor_parallel_problems
from pipetrain.parallel.pipeline.stage import stage_layout

BASE = {"model": {"d_model": 64, "n_layers": 2, "n_heads": 4}, "data": {"path": "x", "tokenizer": "y"}}
LLAMA = ModelConfig(family="llama", vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2,
                    ffn_hidden=64, max_seq_len=32)


def _recipe(model=LLAMA, **parallel) -> Recipe:
    return Recipe(model=model, parallel=ParallelConfig(**parallel), train=TrainConfig(global_batch=8, seq_len=16))


def test_layout_must_divide_world_and_batch():
    r = build_recipe({**BASE, "train": {"global_batch": 6}, "parallel": {"microbatches": 4}})
    problems = layout_problems(r, 2)
    assert any("train.global_batch=6 must be divisible by dp*microbatches=2*4=8" in p for p in problems)


def test_world_not_divisible_by_tp_pp_and_explicit_dp_that_misses_the_world():
    (problem,) = layout_problems(_recipe(tp=2), 3)
    assert problem.startswith("world size 3 is not divisible by parallel.tp*parallel.pp=2")
    (problem,) = layout_problems(_recipe(dp=2, tp=2), 8)
    assert "parallel.dp*tp*pp=2*2*1=4 does not equal the world size 8" in problem
    assert layout_problems(_recipe(tp=2, pp=2), 8) == []  # dp = 8 / 4 = 2 divides the batch of 8


def test_every_kind_of_problem_is_reported_at_once():
    cfg = dataclasses.replace(LLAMA, n_heads=6, d_model=48)
    problems = layout_problems(_recipe(cfg, tp=4, pp=8, microbatches=3), 3)
    text = "\n".join(problems)
    assert "world size 3 is not divisible" in text
    assert "model.n_heads=6" in text
    assert "exceeds model.n_layers=4" in text


def test_tensor_parallel_problems_reports_every_problem_at_once():
    cfg = ModelConfig(vocab_size=102, d_model=48, n_heads=6, n_kv_heads=3, ffn_hidden=90)
    problems = tensor_parallel_problems(cfg, 4)
    text = "\n".join(problems)
    assert len(problems) == 4, problems
    assert "model.n_heads=6" in text and "model.n_kv_heads=3" in text
    assert "model.ffn_hidden=90" in text and "model.vocab_size=102" in text
    assert tensor_parallel_problems(ModelConfig(n_heads=8, n_kv_heads=2, vocab_size=64), 4) == []
    assert tensor_parallel_problems(ModelConfig(n_heads=8, n_kv_heads=2, vocab_size=64), 8) == []


def test_sequence_parallel_needs_a_sequence_length_divisible_by_tp():
    cfg = ModelConfig(n_heads=8, vocab_size=64)
    (problem,) = tensor_parallel_problems(cfg, 4, seq_len=30, sequence_parallel=True)
    assert problem.startswith("train.seq_len: must be divisible by parallel.tp=4") and "got 30" in problem
    assert tensor_parallel_problems(cfg, 4, seq_len=30, sequence_parallel=False) == []


def test_bad_pipeline_layouts_are_reported():
    assert "exceeds model.n_layers=4" in " ".join(pipeline_problems(LLAMA, ParallelConfig(pp=8)))
    msg = " ".join(pipeline_problems(LLAMA, ParallelConfig(pp=2, stage_layers=[1, 1])))
    assert "stage_layers=[1, 1]" in msg and "summing to model.n_layers=4" in msg
    msg = " ".join(pipeline_problems(LLAMA, ParallelConfig(pp=2, stage_layers=[1, 0])))
    assert "must list 2 positive layer counts" in msg
    msg = " ".join(pipeline_problems(LLAMA, ParallelConfig(pp=2, virtual_stages=2, microbatches=3,
                                                           schedule="interleaved-1f1b")))
    assert "multiple of parallel.pp=2" in msg
    msg = " ".join(pipeline_problems(ModelConfig(family="llama", n_layers=6, d_model=32, n_heads=4),
                                     ParallelConfig(pp=2, virtual_stages=2, microbatches=2,
                                                    schedule="interleaved-1f1b")))
    assert "not divisible by pp*virtual_stages=4" in msg


def test_virtual_stages_need_the_interleaved_schedule_and_two_ranks():
    msg = " ".join(pipeline_problems(LLAMA, ParallelConfig(pp=2, virtual_stages=2, microbatches=2)))
    assert "needs parallel.schedule=interleaved-1f1b, got 1f1b" in msg
    msg = " ".join(pipeline_problems(LLAMA, ParallelConfig(pp=1, virtual_stages=2, schedule="interleaved-1f1b")))
    assert "needs parallel.pp >= 2, got 1" in msg


def test_lower_layers_assert_what_layout_problems_reports():
    pcfg = ParallelConfig(pp=2, stage_layers=[2, 3])
    assert "sums to 5, not model.n_layers=4" in " ".join(layout_problems(_recipe(pp=2, stage_layers=[2, 3]), 2))
    with pytest.raises(AssertionError, match="layout_problems rejects this"):
        stage_layout(LLAMA, pcfg, 16)


@pytest.mark.parametrize("parallel, message", [
    (dict(tp=0), "parallel.tp=0 must be >= 1"),
    (dict(virtual_stages=0), "parallel.virtual_stages=0 must be >= 1"),
    (dict(dp=0), "parallel.dp=0 must be >= 1"),
    (dict(zero=4), "parallel.zero=4 is not offered; use 0, 1, 2 or 3"),
    (dict(ft_connect_timeout_s=0.0), "parallel.ft_connect_timeout_s=0.0 must be a positive number of seconds "
                                     "(torchft's default is 60)"),
    (dict(staleness_min=-1), "parallel.staleness_min: must be >= 0, got -1; use 0 or more"),
    (dict(sync_warmup_steps=-1), "parallel.sync_warmup_steps: must be >= 0, got -1"),
])
def test_parallel_problems_keep_the_messages_config_gave(parallel, message):
    """The rules that moved out of config.validate report the same text (one problem each here)."""
    assert parallel_problems(Recipe(parallel=ParallelConfig(**parallel))) == [message]
    assert parallel_problems(Recipe()) == []


@pytest.mark.parametrize("parallel, train, model, key", [
    (dict(dp_sync="diloco"), {}, {}, "parallel.dp_sync=diloco"),
    (dict(ps_servers=1), {}, dict(tie_embeddings=False), "parallel.ps_servers"),
])
def test_zero3_refuses_what_it_does_not_compose_with_in_one_line(parallel, train, model, key):
    recipe = Recipe(model=dataclasses.replace(LLAMA, **model), parallel=ParallelConfig(zero=3, **parallel),
                    train=TrainConfig(global_batch=8, seq_len=16, **train))
    problems = [p for p in parallel_problems(recipe) if "parallel.zero=3" in p]
    assert len(problems) == 1 and problems[0].startswith(f"{key}") and "does not combine with parallel.zero=3" \
        in problems[0], problems
    # the same layout at zero 2 raises nothing about zero 3
    assert not [p for p in parallel_problems(dataclasses.replace(recipe, parallel=dataclasses.replace(
        recipe.parallel, zero=2))) if "zero=3" in p]


@pytest.mark.parametrize("parallel, model", [
    (dict(pp=2, tp=2, microbatches=2, recompute="full", reshard_after_forward=False), {}),
    (dict(pp=2, schedule="interleaved-1f1b", virtual_stages=2, microbatches=4), {}),
    (dict(pp=2, schedule="zbv", virtual_stages=2, microbatches=4, split_backward=True), {}),
    (dict(pp=2, schedule="dualpipev", virtual_stages=2, microbatches=4), {}),
    (dict(pp=2, split_backward=True), {}),
    (dict(dp_shard=2, dynamic_batch=True, microbatches=4), dict(lora_rank=4)),
], ids=["1f1b_tp_keep_gathered", "interleaved", "zbv", "dualpipev", "split_backward", "hsdp_dbs_lora"])
def test_zero3_takes_every_schedule_split_backward_lora_hsdp_dbs_and_bf16(parallel, model):
    recipe = Recipe(model=dataclasses.replace(LLAMA, **model), parallel=ParallelConfig(zero=3, **parallel),
                    train=TrainConfig(global_batch=8, seq_len=16, precision="bf16"))
    assert parallel_problems(recipe) == []


def test_zero3_takes_fp8_with_tp_and_pp():
    recipe = Recipe(model=LLAMA, parallel=ParallelConfig(zero=3, tp=2, pp=2, microbatches=2, sequence_parallel=True),
                    train=TrainConfig(global_batch=8, seq_len=16, precision="fp8", compile=True))
    assert parallel_problems(recipe) == [] and layout_problems(recipe, 8) == []


# -- one place for the rules on parallel keys -------------------------------------------------------------
ROOT = pathlib.Path(__file__).resolve().parents[2]
MESH = ROOT / "pipetrain" / "parallel" / "mesh"
# a parallel key named in a message ("parallel.dp_sync=...", "set parallel.tp=2"), not a module path
# ("pipetrain.parallel.mesh" has a dot before it)
PARALLEL_KEY = re.compile(r"(?<![\w.])parallel\.[a-z_]+")
# *_problems functions outside parallel/mesh/ allowed to name parallel keys, and why
OWN_RULES = {("parallel/pipeline/schedules/builders.py", "schedule_problems"):
             "a schedule's own rules; the builders assert them and the layout check calls them"}


def _messages(node: ast.AST) -> list[str]:
    """The string constants under node (f-string parts included), docstrings left out."""
    docs = {id(n.body[0].value) for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Module))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(node)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_rules_on_parallel_keys_live_in_parallel_mesh_only():
    """No function outside parallel/mesh/ named *_problems (or config's validate) reports on a parallel key:
    config.validate takes the parallel rules as a callable, and the old homes of these rules are gone."""
    found = []
    for path in sorted((ROOT / "pipetrain").rglob("*.py")):
        if path.is_relative_to(MESH):
            continue
        rel = path.relative_to(ROOT / "pipetrain").as_posix()
        for fn in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            is_rule = isinstance(fn, ast.FunctionDef) and (fn.name.endswith("_problems") or
                                                           (rel.startswith("config") and fn.name == "validate"))
            if is_rule and (rel, fn.name) not in OWN_RULES and any(PARALLEL_KEY.search(s) for s in _messages(fn)):
                found.append(f"{rel}:{fn.name}")
    assert not found, f"rules on parallel keys outside pipetrain/parallel/mesh/: {found}"


def test_fp8_takes_lora_and_refuses_replicated_kv_heads_in_the_layout():
    lora = Recipe(model=dataclasses.replace(LLAMA, lora_rank=4), train=TrainConfig(precision="fp8"))
    assert parallel_problems(lora) == []  # frozen fp8 bases, bf16 adapters (tests/unit/test_fp8_lora.py)
    kv = Recipe(model=dataclasses.replace(LLAMA, n_kv_heads=1), parallel=ParallelConfig(tp=2),
                train=TrainConfig(precision="fp8", global_batch=8, seq_len=16))
    assert [m for m in layout_problems(kv, 2) if "fp8" in m] == [
        "train.precision=fp8: parallel.tp=2 replicates model.n_kv_heads=1 (their gradients are tp-partial, so fp8 "
        "scales cannot match tp=1); use a tp that divides n_kv_heads, or train.precision=bf16"]
    bf16 = dataclasses.replace(kv, train=TrainConfig(precision="bf16", global_batch=8, seq_len=16))
    assert not [m for m in layout_problems(bf16, 2) if "fp8" in m]


@pytest.mark.parametrize("parallel, expected", [
    ({"zero": 3}, []),  # both compose with zero 3 (tests/dist/test_compile.py, test_fused_loss.py)
    ({"cp": 2}, []),  # and with cp (tests/dist/test_context_parallel.py)
], ids=["zero3", "cp"])
def test_compile_and_the_fused_loss_compose_with_zero3_and_cp(parallel, expected):
    on = Recipe(model=LLAMA, parallel=ParallelConfig(**parallel),
                train=TrainConfig(global_batch=8, seq_len=16, compile=True, fused_loss=True))
    assert [m for m in parallel_problems(on) if "compile" in m or "fused_loss" in m] == expected
    off = dataclasses.replace(on, train=TrainConfig(global_batch=8, seq_len=16, fused_loss="auto"))
    assert not [m for m in parallel_problems(off) if "compile" in m or "fused_loss" in m]
