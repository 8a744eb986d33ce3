"""ParallelDims rank arithmetic and group layout, without processes."""
import pytest

from pipetrain.config import ParallelConfig
from pipetrain.parallel.mesh.dims import ParallelDims, mesh_rank_lists


def test_global_rank_is_dp_major_then_pp_then_tp():
    for rank in range(8):
        d = ParallelDims(dp=2, tp=2, pp=2, rank=rank)
        assert rank == d.dp_rank * 4 + d.pp_rank * 2 + d.tp_rank
        assert d.global_rank(d.dp_rank, d.pp_rank, d.tp_rank) == rank
    d = ParallelDims(dp=2, tp=2, pp=2, rank=3)
    assert (d.dp_rank, d.pp_rank, d.tp_rank) == (0, 1, 1)
    assert d.coords == "[rank 3 | dp 0 tp 1 pp 1]"


def test_group_rank_lists_partition_the_world_along_each_axis():
    d = ParallelDims(dp=2, tp=2, pp=2)
    lists = d.group_rank_lists()
    assert lists["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lists["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lists["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lists["embed"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    for kind in ("tp", "pp", "dp"):
        assert sorted(r for g in lists[kind] for r in g) == list(range(8))


def test_degree_one_kinds_have_no_groups():
    lists = ParallelDims(dp=4, tp=1, pp=1).group_rank_lists()
    assert lists == {"tp": [], "cp": [], "pp": [], "dp": [[0, 1, 2, 3]], "embed": [], "dp_cp": [],
                     "dp_shard": [], "dp_replicate": [], "replica": [], "ep": [], "expert_dp": [],
                     "expert_dp_cp": [], "expert_dp_shard": []}


def test_embed_group_joins_first_and_last_stage_of_the_same_dp_tp():
    d = ParallelDims(dp=1, tp=2, pp=3, rank=5)  # dp 0, pp 2, tp 1: the last stage
    assert [1, 5] in d.group_rank_lists()["embed"]


def test_mesh_rank_lists_spans_several_axes_for_a_future_dp_split():
    shape = {"dp_replicate": 2, "dp_shard": 2, "pp": 1, "tp": 2}
    assert mesh_rank_lists(shape, ("dp_shard",)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh_rank_lists(shape, ("dp_replicate", "dp_shard")) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_single_process_init_has_no_groups():
    d = ParallelDims.init(ParallelConfig())
    assert (d.dp, d.tp, d.pp, d.rank, d.world_size) == (1, 1, 1, 0, 1)
    assert d.tp_group is None and d.dp_group is None and d.pp_group is None and d.embed_group is None
    assert d.mesh is None  # no process group, no device mesh


# The user-facing layout rules live in the CLI's layout check; from here they are internal invariants.
@pytest.mark.parametrize("cfg, world_size, fragment", [
    (ParallelConfig(tp=2), 1, "world size 1 is not divisible by tp*pp=2*1"),
    (ParallelConfig(dp=2), 1, "dp*tp*pp=2*1*1 does not equal the world size 1"),
    (ParallelConfig(tp=0), 1, "tp=0, pp=1"),
])
def test_layout_that_does_not_fit_the_world_fails_an_assertion(cfg, world_size, fragment):
    with pytest.raises(AssertionError, match=fragment.replace("*", r"\*")):
        ParallelDims.init(cfg, world_size=world_size)


def test_requested_world_size_must_match_the_launched_processes():
    with pytest.raises(AssertionError, match="world size 4 was requested but 1 processes"):
        ParallelDims.init(ParallelConfig(tp=2), world_size=4)


def test_rank_outside_the_mesh_fails_an_assertion():
    with pytest.raises(AssertionError, match="rank 4 is outside the mesh"):
        ParallelDims(dp=2, tp=2, rank=4)
