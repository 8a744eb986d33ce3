"""ParallelDims on a DeviceMesh: the groups read from the mesh have the rank lists of the row-major
(dp, pp, cp, tp) arithmetic (tp fastest), degree-1 dims stay None, the embed group joins the first
and last stage, and the dp x cp gradient group spans every rank of one (pp, tp) coordinate. The expected
lists come from mesh_rank_lists, computed with no processes."""
import pytest
import torch
import torch.distributed as dist

from pipetrain.parallel.mesh.dims import MESH_DIM_NAMES, ParallelDims, mesh_rank_lists
from tests.harness import run_ranks


def _check_layouts(rank, world_size, layouts):
    for dp, pp, cp, tp in layouts:
        dims = ParallelDims.from_degrees(dp=dp, pp=pp, cp=cp, tp=tp)
        where = f"{dims.coords} dp{dp} pp{pp} cp{cp} tp{tp}"
        assert dims.mesh.mesh_dim_names == MESH_DIM_NAMES, where
        assert dims.mesh.mesh.tolist() == torch.arange(world_size).reshape(dp, pp, cp, tp).tolist(), where
        assert dims.mesh.get_coordinate() == (dims.dp_rank, dims.pp_rank, dims.cp_rank, dims.tp_rank), where
        expected = dims.group_rank_lists()
        # the gradient group: dp x cp, also when one of them is 1 (then it is the dp or the cp group itself)
        expected["dp_cp"] = mesh_rank_lists(dims.mesh_shape, ("dp", "cp")) if dp * cp > 1 else []
        for kind in (*MESH_DIM_NAMES, "embed", "dp_cp"):
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
    run_ranks(4, _check_layouts, [(2, 1, 1, 2), (2, 2, 1, 1), (1, 2, 1, 2), (4, 1, 1, 1), (2, 1, 2, 1),
                                  (1, 1, 2, 2)])


@pytest.mark.slow
def test_mesh_groups_match_the_row_major_rank_lists_on_8_ranks():
    run_ranks(8, _check_layouts, [(2, 2, 1, 2), (2, 2, 2, 1), (2, 1, 2, 2)])
