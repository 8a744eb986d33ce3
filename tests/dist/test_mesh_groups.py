"""ParallelDims on a DeviceMesh: the groups read from the mesh have the rank lists of the row-major
(dp, pp, tp) arithmetic (tp fastest), degree-1 dims stay None, and the embed group joins the first
and last stage. The expected lists come from mesh_rank_lists, computed with no processes."""
import pytest
import torch
import torch.distributed as dist

from pipetrain.parallel.mesh.dims import MESH_DIM_NAMES, ParallelDims
from tests.harness import run_ranks


def _check_layouts(rank, world_size, layouts):
    for dp, pp, tp in layouts:
        dims = ParallelDims.from_degrees(dp=dp, pp=pp, tp=tp)
        where = f"{dims.coords} dp{dp} pp{pp} tp{tp}"
        assert dims.mesh.mesh_dim_names == MESH_DIM_NAMES, where
        assert dims.mesh.mesh.tolist() == torch.arange(world_size).reshape(dp, pp, tp).tolist(), where
        assert dims.mesh.get_coordinate() == (dims.dp_rank, dims.pp_rank, dims.tp_rank), where
        expected = dims.group_rank_lists()
        for kind in (*MESH_DIM_NAMES, "embed"):
            group = getattr(dims, f"{kind}_group")
            mine = [ranks for ranks in expected[kind] if rank in ranks]
            if not mine:  # degree 1, or a middle pipeline stage for embed
                assert group is None, f"{where}: {kind} group should be None"
                continue
            assert dist.get_process_group_ranks(group) == mine[0], f"{where}: {kind} group"
            total = torch.tensor([float(rank)])
            dist.all_reduce(total, group=group)
            assert total.item() == sum(mine[0]), f"{where}: all-reduce over the {kind} group"


def test_mesh_groups_match_the_row_major_rank_lists_on_4_ranks():
    run_ranks(4, _check_layouts, [(2, 1, 2), (2, 2, 1), (1, 2, 2), (4, 1, 1)])


@pytest.mark.slow
def test_mesh_groups_match_the_row_major_rank_lists_on_8_ranks():
    run_ranks(8, _check_layouts, [(2, 2, 2)])
