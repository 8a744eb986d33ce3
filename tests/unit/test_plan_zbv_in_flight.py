"""The planner's zbv schedule is the one a zbv run executes: build._training_schedule orders zbv's computes by the
layout's stage costs (schedules.zbv_orders), and the planner (plan/in_flight.py, and the makespan cost.py scales)
now builds it with the same costs. Before, it built zbv without them: at pp 4 with 4 microbatches it counted 8
(microbatch, chunk) units in flight on every rank where the run holds 5, 6, 7 and 8, so the memory model charged
ranks 0-2 (rank 0 holds the embedding and the head under zbv's V) activations they never hold."""
import itertools

import pytest

from pipetrain.config import ModelConfig, ParallelConfig, Recipe, TrainConfig
from pipetrain.parallel.mesh.rules import layout_problems, parallel_problems
from pipetrain.parallel.pipeline.schedules import build_schedule, peak_in_flight
from pipetrain.parallel.pipeline.stage import stage_costs
from pipetrain.plan.in_flight import schedule_in_flight


@pytest.mark.filterwarnings("ignore")  # 1f1b with fewer microbatches than stages warns; the planner scores it
@pytest.mark.parametrize("layers, vocab", [(8, 256), (12, 32000)])
def test_the_planner_counts_the_in_flight_units_of_the_schedule_the_run_executes(layers, vocab):
    model = ModelConfig(family="llama", vocab_size=vocab, d_model=64, n_layers=layers, n_heads=4, n_kv_heads=2,
                        ffn_hidden=128, max_seq_len=64)
    checked = 0
    for schedule, v, pp, m, split in itertools.product(("1f1b", "interleaved-1f1b", "zbv", "dualpipev"), (1, 2),
                                                       (2, 4), (2, 4, 8), (False, True)):
        recipe = Recipe(model=model, train=TrainConfig(global_batch=16, seq_len=32),
                        parallel=ParallelConfig(pp=pp, microbatches=m, schedule=schedule, virtual_stages=v,
                                                split_backward=split))
        if parallel_problems(recipe) or layout_problems(recipe, pp):
            continue
        costs = stage_costs(model, recipe.parallel, 32) if schedule == "zbv" else None  # as build.py passes them
        run = [peak_in_flight(build_schedule(schedule, r, pp, m, v, backward_cost=2.0, split_backward=split,
                                             stage_costs=costs)) for r in range(pp)]
        assert schedule_in_flight(recipe, pp) == run, (schedule, v, pp, m, split)
        checked += 1
    assert checked > 20
