"""Elastic resume: a checkpoint resumed on another world keeps tp and pp, takes dp from the world (even a pinned
one), keeps its microbatch size where the layout allows, and never changes the global batch."""
import dataclasses
import os
import shutil

import pytest

from pipetrain.config import ConfigError, ModelConfig, ParallelConfig, Recipe, TrainConfig
from pipetrain.elastic import SavedLayout, elastic_recipe, is_elastic, launch_layout, saved_layout
from pipetrain.parallel.mesh.rules import layout_problems
from pipetrain.plan.auto import resolve_at_launch
from tests.unit.short_run import short_run

LLAMA = ModelConfig(family="llama", vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2,
                    ffn_hidden=64, max_seq_len=32)


def _recipe(**parallel) -> Recipe:
    return Recipe(model=LLAMA, parallel=ParallelConfig(**parallel), train=TrainConfig(global_batch=16, seq_len=16))


def _saved(dp, tp=1, pp=1, microbatches=2, global_batch=16) -> SavedLayout:
    return SavedLayout(path="ckpt", dp=dp, tp=tp, pp=pp, microbatches=microbatches, global_batch=global_batch)


def test_the_same_world_changes_nothing():
    recipe = _recipe(dp=4, microbatches=2)
    assert elastic_recipe(recipe, 4, _saved(4)) == (recipe, None)
    assert elastic_recipe(recipe, 4, None) == (recipe, None)


def test_a_shrunk_world_takes_dp_from_the_world_and_keeps_the_microbatch_size():
    # 4 replicas x 2 microbatches of 2 sequences -> 2 replicas x 4 microbatches of 2 sequences
    got, note = elastic_recipe(_recipe(dp=4, microbatches=2), 2, _saved(4))
    assert (got.parallel.dp, got.parallel.microbatches, got.train.global_batch) == (2, 4, 16)
    assert not layout_problems(got, 2)
    assert "saved on 4 rank(s) (dp 4 x tp 1 x pp 1, 2 microbatch(es) of 2 sequence(s) per replica)" in note
    assert "on 2 rank(s): dp 2 x tp 1 x pp 1, 4 microbatch(es) of 2 sequence(s) per replica; global batch 16" in note


def test_a_grown_world_keeps_tp_and_pp():
    recipe = _recipe(tp=2, pp=2, microbatches=8, schedule="1f1b")
    got, _ = elastic_recipe(recipe, 8, _saved(1, 2, 2, 8))
    p = got.parallel
    assert (p.dp, p.tp, p.pp, p.microbatches) == (2, 2, 2, 4) and not layout_problems(got, 8)


def test_a_microbatch_size_the_new_layout_refuses_falls_back_to_the_nearest_count_it_accepts():
    # saved: one replica, one microbatch of 16 sequences; dualpipev at pp 2 needs >= 2*pp = 4 microbatches,
    # so the saved size (1 microbatch) is refused and the nearest accepted count, 4, is taken
    recipe = _recipe(pp=2, virtual_stages=2, schedule="dualpipev", microbatches=4)
    got, note = elastic_recipe(recipe, 2, _saved(1, microbatches=1))
    assert got.parallel.microbatches == 4 and not layout_problems(got, 2)
    assert "4 microbatch(es) of 4 sequence(s) per replica" in note


def test_a_world_that_tp_times_pp_does_not_divide_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"elastic resume: ckpt was saved on 4 rank\(s\).*world size 3 is not "
                                          r"divisible by parallel.tp\*parallel.pp=2; launch a multiple of 2"):
        elastic_recipe(_recipe(tp=2, microbatches=2), 3, _saved(2, tp=2))


def test_a_dp_the_global_batch_cannot_split_over_is_refused():
    recipe = Recipe(model=LLAMA, parallel=ParallelConfig(dp=2), train=TrainConfig(global_batch=6, seq_len=16))
    with pytest.raises(ConfigError, match=r"elastic resume: .*train.global_batch=6 must be divisible by dp"):
        elastic_recipe(recipe, 4, _saved(2, microbatches=1, global_batch=6))


def test_a_second_resume_on_the_shrunk_world_is_elastic_again():
    """The shrunk run saved on 1 rank; the recipe still pins dp=2 for the first world."""
    recipe = _recipe(dp=2, microbatches=2)
    saved_on_shrunk = _saved(1, microbatches=8)  # 1 replica x 8 microbatches of 2 sequences
    assert is_elastic(recipe, saved_on_shrunk, 1) and not is_elastic(recipe, None, 1)
    got, note = elastic_recipe(recipe, 1, saved_on_shrunk)
    assert (got.parallel.dp, got.parallel.microbatches) == (1, 8) and "saved on 1 rank(s)" in note
    assert not is_elastic(_recipe(microbatches=2), _saved(2), 2)  # dp follows the world it was saved on


def test_a_pinned_dp_shard_that_no_longer_divides_dp_takes_its_default():
    got, note = elastic_recipe(_recipe(dp=4, dp_shard=4, zero=1, microbatches=1), 2, _saved(4, microbatches=1))
    assert got.parallel.dp_shard is None and "parallel.dp_shard=4 does not divide dp 2" in note
    assert not layout_problems(got, 2)


def test_auto_re_plans_an_elastic_resume_with_dp_left_free(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("parallel: {auto: true, dp: 4}\n")
    recipe = _recipe(auto=True, dp=4)
    got = resolve_at_launch(recipe, str(path), [], 2, rank=1, free=("dp",))
    assert got.parallel.dp * got.parallel.tp * got.parallel.pp == 2 and not layout_problems(got, 2)
    with pytest.raises(ConfigError, match="fixed keys"):  # without the elastic exemption dp=4 cannot fit 2
        resolve_at_launch(recipe, str(path), [], 2, rank=1)


def test_saved_layout_reads_the_newest_checkpoint_whose_manifest_reads(tmp_path):
    out, _, _ = short_run()  # one process, checkpoints at steps 3 and 6
    shutil.copytree(os.path.join(out, "checkpoints"), tmp_path / "checkpoints")
    newest = saved_layout(str(tmp_path), "auto")
    assert newest.path.endswith("step-00000006")
    assert (newest.dp, newest.tp, newest.pp, newest.world_size) == (1, 1, 1, 1)
    assert newest.micro_size * newest.microbatches == newest.global_batch
    (tmp_path / "checkpoints" / "step-00000006" / "manifest.json").write_text("{not json")
    assert saved_layout(str(tmp_path), "auto").path.endswith("step-00000003")
    assert saved_layout(str(tmp_path), None) is None and saved_layout(str(tmp_path / "none"), "auto") is None
    with pytest.raises(ConfigError, match="no such checkpoint directory"):
        saved_layout(str(tmp_path), str(tmp_path / "missing"))


def test_launch_layout_re_plans_under_auto_and_re_derives_otherwise(tmp_path):
    out, _, _ = short_run()  # saved on 1 rank
    shutil.copytree(os.path.join(out, "checkpoints"), tmp_path / "checkpoints")
    path = tmp_path / "r.yaml"
    path.write_text("parallel: {auto: true, dp: 2}\n")
    run = dataclasses.replace(_recipe().run, output_dir=str(tmp_path))
    auto = dataclasses.replace(_recipe(auto=True, dp=2), run=run)
    got, note = launch_layout(auto, str(path), [], 1, rank=1, resume="auto")
    assert got.parallel.dp == 1 and "parallel.auto re-planned for 1" in note
    assert launch_layout(auto, str(path), [], 2, rank=1, resume=None)[1] is None  # a fresh run: not elastic
    pinned = dataclasses.replace(_recipe(dp=2, microbatches=1), run=run)
    got, note = launch_layout(pinned, str(path), [], 1, rank=1, resume="auto")
    assert got.parallel.dp == 1 and note.startswith("elastic resume: ")
