"""One memory model: the pre-flight check, train.py --dry-run and parallel.auto report the same per-rank bytes
(pipetrain.plan.memory.run_memory), and that model holds what the replica modes and parameter servers hold.

Each recipe's figures are compared as numbers: preflight.check_model_fits returns the estimate it checked,
dry_run.dry_run_details the figures it prints, and parallel.auto's Plan (resolve_auto with every search key
fixed to the recipe's layout) the figures it ranked by. Nothing runs; the sizes themselves are checked against
measured peaks by benchmarks/memory.py (docs/benchmarks.md)."""
from __future__ import annotations

import dataclasses

import pytest

from pipetrain import preflight
from pipetrain.config import ConfigError, ParallelConfig, Recipe, TrainConfig
from pipetrain.dry_run import dry_run_details
from pipetrain.parallel.mesh.rules import layout_problems, resolve_dp
from pipetrain.plan import shapes as shapes_module
from pipetrain.plan.auto import resolve_auto
from pipetrain.plan.devices import DEVICES, DeviceProfile
from pipetrain.plan.in_flight import schedule_shape
from pipetrain.plan.memory import FP32, model_state_bytes, rank_memory
from pipetrain.plan.search import KEYS
from pipetrain.preflight import check_model_fits
from tests.unit.common import LLAMA

# (name, parallel keys, mesh world size)
RECIPES = [
    ("plain", {}, 1),
    ("zero1", {"dp": 2, "zero": 1}, 2),
    ("zero3", {"dp": 2, "zero": 3}, 2),  # rows of everything plus two units whole (plan.memory.model_state_bytes)
    ("ssp", {"dp": 2, "dp_sync": "ssp", "staleness": 2}, 2),
    ("diloco", {"dp": 2, "dp_sync": "diloco", "sync_every": 2, "outer_momentum": 0.9}, 2),
    ("ps", {"dp": 2, "ps_servers": 2}, 2),
    ("dbs", {"dp": 2, "pp": 2, "schedule": "gpipe", "microbatches": 4, "dynamic_batch": True}, 4),
    ("tp-pp", {"tp": 2, "pp": 2, "microbatches": 2}, 4),
]
CPU = DeviceProfile(**{**DEVICES["cpu"].as_dict(), "memory_bytes": 1e15})  # gloo, like the checks on this machine


def _recipe(parallel: dict) -> Recipe:
    return Recipe(model=LLAMA, parallel=ParallelConfig(**parallel), train=TrainConfig(global_batch=16, seq_len=16))


@pytest.mark.parametrize("name,parallel,world", RECIPES, ids=[r[0] for r in RECIPES])
def test_preflight_dry_run_and_auto_report_identical_per_rank_bytes(name, parallel, world):
    recipe = _recipe(parallel)
    assert not layout_problems(recipe, world), layout_problems(recipe, world)
    preflight = check_model_fits(recipe, world)
    dry_run = dry_run_details(recipe, world)[1]
    fixed = {k: getattr(recipe.parallel, k) for k in KEYS}
    fixed["dp"] = resolve_dp(recipe, world)
    resolved, plan = resolve_auto(dataclasses.replace(recipe, parallel=dataclasses.replace(recipe.parallel, auto=True)),
                                  world, fixed, CPU)
    assert {k: getattr(resolved.parallel, k) for k in KEYS} == fixed  # the plan is this recipe's layout
    expected_ranks = recipe.parallel.pp + recipe.parallel.ps_servers
    for figures in (preflight, dry_run, plan.memory):
        assert len(figures) == expected_ranks
    assert [r.as_dict() for r in preflight] == [r.as_dict() for r in dry_run] == [r.as_dict() for r in plan.memory]


def test_the_model_holds_what_the_replica_modes_and_servers_hold():
    plain = rank_memory(_recipe({"dp": 2}), 2)[0]
    params = plain.params
    ssp = rank_memory(_recipe({"dp": 2, "dp_sync": "ssp", "staleness": 2}), 2)[0]
    assert ssp.pending == 2 * params and ssp.exchange_temp == params  # s copies between steps, s + 1 at the update
    assert ssp.total > plain.total
    diloco = rank_memory(_recipe({"dp": 2, "dp_sync": "diloco", "outer_momentum": 0.9}), 2)[0]
    assert diloco.replica_state == 2 * params and diloco.sync_temp == 2 * params
    no_momentum = rank_memory(_recipe({"dp": 2, "dp_sync": "diloco", "outer_momentum": 0.0}), 2)[0]
    assert no_momentum.replica_state == params
    zero_ssp = rank_memory(_recipe({"dp": 4, "dp_shard": 2, "zero": 1, "dp_sync": "ssp", "staleness": 1}), 4)[0]
    assert zero_ssp.pending == zero_ssp.optim // 2  # ZeRO: the rank's rows are exchanged
    ps = _recipe({"dp": 2, "ps_servers": 3})
    table = LLAMA.vocab_size * LLAMA.d_model * FP32
    assert model_state_bytes(ps, 2, 0)[0] == params - table  # workers hold no table ...
    servers = [r for r in check_model_fits(ps, 2) if r.role == "server"]
    assert [r.params for r in servers] == [22 * 32 * FP32, 22 * 32 * FP32, 20 * 32 * FP32]  # ... servers their rows
    assert all(r.optim == 2 * r.params and r.sync_temp == 4 * r.params for r in servers)  # bsp: the fp64 norm


def test_dynamic_batch_sizes_the_schedule_by_the_largest_share():
    static = _recipe({"dp": 2, "pp": 2, "schedule": "gpipe", "microbatches": 4})
    dbs = dataclasses.replace(static, parallel=dataclasses.replace(static.parallel, dynamic_batch=True))
    largest = 2 * 4 - 1  # the other replica keeps one microbatch
    assert [r.activations for r in rank_memory(dbs, 4)] == \
        [r.activations for r in rank_memory(static, 4, in_flight=list(schedule_shape("gpipe", 2, largest, 1, False,
                                                                                       2.0)[1]))]
    assert rank_memory(dbs, 4)[0].activations > rank_memory(static, 4)[0].activations


@pytest.mark.parametrize("role", ["worker", "server"])
def test_preflight_refuses_only_when_the_estimate_less_its_margin_exceeds_the_memory(monkeypatch, role):
    recipe = _recipe({"dp": 2, "ps_servers": 1})
    estimate = check_model_fits(recipe, 2)
    need = max(r.total for r in estimate if r.role == role) * (1 - preflight.MARGIN)
    plenty = (1e15, "test")

    def available(amount):
        monkeypatch.setattr(preflight, "device_memory", lambda n: (amount, "test") if role == "worker" else plenty)
        monkeypatch.setattr(preflight, "host_memory", lambda n: (amount, "test") if role == "server" else plenty)
    available(need + 1)
    check_model_fits(recipe, 2)  # within the model's margin: not certain, so the run goes ahead
    available(need - 1)
    with pytest.raises(ConfigError, match="parameter server 0" if role == "server" else "pp rank 0"):
        check_model_fits(recipe, 2)


def test_a_million_layer_pipeline_is_refused_before_any_stage_split(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the size check computed a stage split")

    monkeypatch.setattr(shapes_module, "stage_layout", refuse)
    shapes_module._stages.cache_clear()
    recipe = _recipe({"pp": 2, "microbatches": 2})
    recipe = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, n_layers=1_000_000))
    with pytest.raises(ConfigError, match="model.n_layers=1000000.*per rank"):
        check_model_fits(recipe, 2)
