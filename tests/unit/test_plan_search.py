"""The layout search: exhaustive over its space (against a brute-force enumeration), deterministic, semi-auto
keeps fixed keys, one line naming the fix when nothing fits, and the command line."""
from __future__ import annotations

import dataclasses
import itertools
import json
import os

import pytest

from pipetrain.config import ConfigError, ModelConfig, ParallelConfig, Recipe, TrainConfig
from pipetrain.parallel.mesh.rules import candidate_problems, layout_problems
from pipetrain.parallel.pipeline.schedules import SCHEDULES
from pipetrain.plan.__main__ import main
from pipetrain.plan.auto import fixed_parallel_keys, resolve_auto
from pipetrain.plan.devices import DEVICES, load_profile
from pipetrain.plan.cost import step_time
from pipetrain.plan.search import KEYS, MAX_VIRTUAL, MICROBATCHES_PER_STAGE, nothing_fits, search

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = ModelConfig(family="llama", vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                    max_seq_len=32)
RECIPE = Recipe(model=MODEL, train=TrainConfig(global_batch=8, seq_len=16))
HUGE = dataclasses.replace(DEVICES["cpu"], memory_bytes=1e15)


def _brute_force(recipe: Recipe, world: int) -> set[tuple]:
    """Every layout of plain ranges that the parallel rules accept, in the search's canonical form (keys that
    do nothing at degree 1 at their default; microbatches capped per stage)."""
    out = set()
    for dp, tp, pp, cp in itertools.product(range(1, world + 1), repeat=4):
        if dp * tp * pp * cp > world:  # never a mesh of this world (saves layout_problems most of the product)
            continue
        for schedule, v, split, mb, zero, rc, sp in itertools.product(
                SCHEDULES, range(1, MAX_VIRTUAL + 1), (False, True), range(1, recipe.train.global_batch + 1),
                (0, 1, 2, 3), ("none", "selective", "full"), (False, True)):
            layout = dict(dp=dp, tp=tp, pp=pp, cp=cp, schedule=schedule, virtual_stages=v, split_backward=split,
                          microbatches=mb, zero=zero, recompute=rc, sequence_parallel=sp)
            canonical = ((pp > 1 or (schedule == ParallelConfig.schedule and v == 1 and not split))
                         and (dp * cp > 1 or zero == 0) and (tp > 1 or not sp)
                         and (pp == 1 or mb <= MICROBATCHES_PER_STAGE * pp))
            candidate = dataclasses.replace(recipe, parallel=ParallelConfig(**layout))
            if canonical and not candidate_problems(candidate, world):
                out.add(tuple(layout[k] for k in KEYS))
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_search_is_exhaustive_over_its_space(world):
    result = search(RECIPE, world, HUGE)
    found = {tuple(p.layout[k] for k in KEYS) for p in result.plans}
    assert not [r for _, r in result.rejected if not r.startswith("does not divide")]  # everything fits
    assert found == _brute_force(RECIPE, world)
    assert len(found) == len(result.plans)  # no layout scored twice


@pytest.mark.parametrize("keys, refused", [(dict(fault_tolerance="torchft"), {1, 2, 3}), (dict(dp_sync="ssp"), {3}),
                                           (dict(ps_servers=1), {3})])
def test_the_planner_never_proposes_a_composition_the_rules_refuse(keys, refused):
    """parallel.auto picked zero 3 under torchft (which refuses every ZeRO stage), ssp and parameter servers: the
    search checked the world size's rules only, not the compositions a hand-set recipe is refused for."""
    recipe = dataclasses.replace(RECIPE, parallel=ParallelConfig(**keys))
    plans = search(recipe, 4, HUGE).plans
    assert plans and not [p.layout for p in plans if p.layout["zero"] in refused]
    assert all(not candidate_problems(dataclasses.replace(recipe, parallel=ParallelConfig(**keys, **p.layout)), 4)
               for p in plans[:5])


def test_ranking_is_deterministic_and_by_tokens_per_second():
    a, b = search(RECIPE, 4, DEVICES["cpu"]), search(RECIPE, 4, DEVICES["cpu"])
    assert [p.layout for p in a.plans] == [p.layout for p in b.plans]
    speeds = [p.time.tokens_per_s for p in a.plans]
    assert all(a >= b * (1 - 1e-9) for a, b in zip(speeds, speeds[1:]))


def test_semi_auto_keeps_fixed_keys():
    fixed = {"tp": 2, "recompute": "full"}
    result = search(RECIPE, 4, HUGE, fixed)
    assert result.plans and all(p.layout["tp"] == 2 and p.layout["recompute"] == "full" for p in result.plans)
    resolved, plan = resolve_auto(dataclasses.replace(RECIPE, parallel=ParallelConfig(auto=True)), 4, fixed, HUGE)
    assert resolved.parallel.tp == 2 and resolved.parallel.recompute == "full"
    assert not layout_problems(resolved, 4)
    assert plan.layout == result.plans[0].layout


def test_fixed_keys_come_from_the_recipe_file_and_overrides(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("model: {d_model: 32}\nparallel: {auto: true, pp: 2, stage_layers: null}\n")
    assert fixed_parallel_keys(str(path), ["parallel.zero=1", "train.steps=3"]) == {"pp": 2, "zero": 1}


def test_when_nothing_fits_one_line_names_the_smallest_world_that_does():
    big = dataclasses.replace(RECIPE, model=dataclasses.replace(MODEL, vocab_size=4096, d_model=256, n_heads=8,
                                                                 n_kv_heads=4, ffn_hidden=512, n_layers=8))
    one_rank = search(big, 1, DEVICES["cpu"]).plans[0].peak_bytes
    small = dataclasses.replace(DEVICES["cpu"], memory_bytes=one_rank * 0.6)
    assert not search(big, 1, small).plans
    line = nothing_fits(big, 1, small)
    assert "\n" not in line and "smallest world size that fits is" in line
    world = int(line.split("smallest world size that fits is ")[1].split()[0])
    assert world > 1 and search(big, world, small).plans


def test_cli_prints_a_ranked_table_and_json(capsys):
    tiny = os.path.join(ROOT, "recipes", "tiny.yaml")
    assert main(["--recipe", tiny, "--nproc", "2", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "layouts fit on 2 x cpu" in out and "rejected:" in out
    assert main(["--recipe", tiny, "--nproc", "2", "--top", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["plans"]) == 3 and data["world_size"] == 2
    assert set(data["plans"][0]["memory"][0]) >= {"params", "grads", "optim", "activations", "comm", "total"}
    assert main(["--recipe", tiny, "--nproc", "2", "--device", "no-such-gpu"]) == 2


def test_device_profiles_load_by_name_and_from_a_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(DEVICES["a100-40gb"].as_dict()))
    assert load_profile(str(path)) == DEVICES["a100-40gb"] == load_profile("a100-40gb")
    assert all(load_profile(name) == profile for name, profile in DEVICES.items())


@pytest.mark.parametrize("content,message", [
    ("not json", r"not a device profile \(Expecting value"),
    ("[1]", r"not a device profile \(.*must be a mapping"),
    ({"memory_bytes": "lots"}, r"not a device profile \(memory_bytes='lots': each must be a finite number"),
    ({"bf16_flops": 0, "fp32_flops": 0},
     r"not a device profile \(bf16_flops=0, fp32_flops=0: each must be a finite number, rates and sizes > 0"),
    ({"intra_latency": -1.0}, r"not a device profile \(intra_latency=-1.0"),
    ("[" * 100_000 + "]" * 100_000, r"not a device profile \(maximum recursion depth"),  # was a RecursionError
    ({"memory_bytes": 10 ** 400}, r"not a device profile \(memory_bytes=1000.*more characters\): each must be a "
                                  "finite number"),  # was an OverflowError in math.isfinite
])
def test_a_device_profile_that_is_not_one_is_refused_in_one_line_naming_its_source(tmp_path, content, message):
    path = tmp_path / "p.json"
    path.write_text(content if isinstance(content, str) else json.dumps({**DEVICES["a100-40gb"].as_dict(), **content}))
    with pytest.raises(ConfigError, match=r"^PIPETRAIN_DEVICE .*p.json: " + message + r".*--calibrate"):
        load_profile(str(path), "PIPETRAIN_DEVICE")


def test_every_v_schedule_layout_the_layout_check_accepts_is_planned():
    # The V schedules place stages r and 2p-1-r on rank r: the memory model and the simulator must be
    # told, or their sends and receives do not pair and the search throws such layouts away.
    result = search(RECIPE, 4, HUGE)
    assert not [reason for _, reason in result.rejected if reason.startswith("schedule")]
    assert {"zbv", "dualpipev"} <= {p.layout["schedule"] for p in result.plans}


def test_auto_chooses_zero3_when_only_it_fits_and_charges_its_gathers():
    """A model whose parameters dominate: with dp 4 (tp and pp fixed at 1) zero 3's rank holds a quarter of
    the parameters plus two units, less than any other stage, so on a device between the two parallel.auto
    picks it. Its step pays a parameter all-gather per unit in every forward and backward pass: where gloo
    overlaps nothing (a CPU profile with cores) that is two gathers per microbatch against zero 2's one."""
    big = dataclasses.replace(RECIPE, model=dataclasses.replace(MODEL, d_model=256, n_heads=8, n_kv_heads=4,
                                                                 ffn_hidden=1024, n_layers=8, vocab_size=4096))
    fixed = {"tp": 1, "pp": 1}
    plans = search(big, 4, HUGE, fixed).plans
    peak = {z: min(p.peak_bytes for p in plans if p.layout["zero"] == z) for z in (0, 1, 2, 3)}
    others = min(peak[z] for z in (0, 1, 2))
    assert peak[3] < others, peak
    device = dataclasses.replace(DEVICES["cpu"], memory_bytes=(peak[3] + others) / 2)
    resolved, plan = resolve_auto(dataclasses.replace(big, parallel=ParallelConfig(auto=True)), 4, fixed, device)
    assert resolved.parallel.zero == 3 and plan.layout["zero"] == 3 and not layout_problems(resolved, 4)

    gloo = dataclasses.replace(HUGE, cores=16)
    layout = {**fixed, "microbatches": 2, "recompute": "none"}
    time = {z: search(big, 4, gloo, {**layout, "zero": z}).plans[0].time for z in (2, 3)}
    assert time[3].dp_comm > time[2].dp_comm and time[3].total > time[2].total
    assert time[3].dp_exposed == time[3].dp_comm  # gloo: the gathers run on the cores the compute needs


LONG = Recipe(model=dataclasses.replace(MODEL, vocab_size=512, d_model=64, ffn_hidden=128, max_seq_len=4096),
              train=TrainConfig(global_batch=1, seq_len=4096))


def test_a_sequence_that_fits_only_with_cp_gets_cp_from_the_planner():
    """One 4096-token sequence on 4 ranks: dp cannot help (one sequence), and the leanest tp / pp layout
    still holds more than a device; cp's slices fit, and parallel.auto picks one of them."""
    lean = search(LONG, 4, HUGE, {"cp": 1}).plans
    least = min(p.peak_bytes for p in lean)
    device = dataclasses.replace(DEVICES["cpu"], memory_bytes=least * 0.95)
    result = search(LONG, 4, device)
    assert lean and result.plans and all(p.layout["cp"] > 1 for p in result.plans)  # every cp 1 layout: too big
    resolved, plan = resolve_auto(dataclasses.replace(LONG, parallel=ParallelConfig(auto=True)), 4, {}, device)
    assert resolved.parallel.cp > 1 and plan.peak_bytes <= device.memory_bytes
    assert not candidate_problems(resolved, 4)


def test_cp_is_left_out_when_data_parallelism_fits():
    """cp costs a K/V exchange per layer that dp does not: with enough sequences for dp, the best is cp 1."""
    recipe = dataclasses.replace(LONG, train=TrainConfig(global_batch=4, seq_len=1024))
    assert search(recipe, 4, HUGE).plans[0].layout["cp"] == 1


@pytest.mark.parametrize("cp, recompute", [(2, "none"), (4, "none"), (2, "selective")])
def test_step_time_charges_the_kv_all_gather_and_its_reduce_scatter(cp, recompute):
    """Per layer and microbatch: forward all-gathers K and V, (cp-1)/cp x 2 x B x T x Hkv x K x dtype bytes,
    backward reduce-scatters their gradients (the same bytes), and a recompute gathers again."""
    gpu = DEVICES["h100-sxm-80gb"]
    m = LONG.model
    recipe = dataclasses.replace(LONG, parallel=ParallelConfig(cp=cp, recompute=recompute),
                                 train=TrainConfig(global_batch=1, seq_len=4096, precision="bf16"))
    nbytes = (cp - 1) / cp * 2 * 1 * 4096 * m.kv_heads * m.head_dim * 2
    one = nbytes / gpu.intra_bw + (cp - 1) * gpu.intra_latency
    collectives = 2 if recompute == "none" else 3
    assert step_time(recipe, cp, gpu).cp_comm == pytest.approx(m.n_layers * collectives * one, rel=1e-9)
    assert step_time(dataclasses.replace(recipe, parallel=ParallelConfig()), 1, gpu).cp_comm == 0.0
