"""FP8 linears (emulated on CPU) under context parallelism: a cp rank holds a slice of each sequence's tokens, so
every amax taken over tokens (tensorwise x and dy; rowwise's per-channel amaxes for dW) is reduced over cp, and
cp=2 quantises exactly as cp=1 (pipetrain/parallel/tensor/fp8.py, "Layouts"). Single linears whose two token
slices differ in size (PATTERNS), so that a scale taken from one slice rounds the other's values otherwise than
the whole tensor's scale does; then the trainer against one process."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.tensor.fp8 import Fp8Linear
from tests.dist.test_context_parallel import LLAMA, cp_trainer, losses_and_norms
from tests.dist.test_fp8 import FP8_TP_CURVE, FP8_TP_FIRST
from tests.harness import TP_FP32, rank_results, run_ranks

B, T, D = 2, 8, 32
RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]


def _spec(recipe: str, **groups) -> Fp8Linear:
    return Fp8Linear(rowwise=recipe != "tensorwise", weight_grad_hp=recipe == "rowwise_with_gw_hp", **groups)


# (x's, dy's) factors on (cp rank 0's, cp rank 1's) tokens. A power-of-two scale changes a value's rounding only
# where one scale puts it among float8's subnormals (or flushes it) and the other does not, and a slice's share of
# dW must stay visible: x large on rank 0 and dy large on rank 1 (e4m3: 2^12 puts the other slice near its
# subnormals; dW's two halves of equal size); then dy 2^30 larger on rank 0 (e5m2's range is 2^30: rank 1's
# gradient flushes under the whole tensor's scale, not under its own).
PATTERNS = (((2 ** 12, 1), (1, 2 ** 12)), ((1, 1), (2 ** 30, 1)))


def _layer_worker(rank, world_size, recipe):
    dims = ParallelDims.from_degrees(cp=world_size)
    mine = slice(dims.cp_rank * T // 2, (dims.cp_rank + 1) * T // 2)
    for (x_factors, g_factors) in PATTERNS:
        torch.manual_seed(0)
        x, g, lin = torch.randn(B, T, D), torch.randn(B, T, D), nn.Linear(D, D)
        for t, factors in ((x, x_factors), (g, g_factors)):
            t[:, :T // 2] *= factors[0]
            t[:, T // 2:] *= factors[1]
        results = []
        for spec, xs, gs in ((_spec(recipe), x, g), (_spec(recipe, cp_group=dims.cp_group), x[:, mine], g[:, mine])):
            xi, w, b = (t.detach().clone().requires_grad_() for t in (xs, lin.weight, lin.bias))
            y = spec(xi, w, b)
            (y * gs).sum().backward()
            results.append((y.detach(), xi.grad, w.grad, b.grad))
        (y_ref, dx_ref, dw_ref, db_ref), (y, dx, dw, db) = results
        for grad in (dw, db):  # each cp rank's sum over its tokens, summed as the trainer's gradient all-reduce does
            dist.all_reduce(grad, group=dims.cp_group)
        for what, got, want in (("y", y, y_ref[:, mine]), ("dx", dx, dx_ref[:, mine]), ("dW", dw, dw_ref),
                                ("db", db, db_ref)):
            torch.testing.assert_close(got, want, **TP_FP32,
                                       msg=lambda m: f"cp rank {dims.cp_rank} {what} {x_factors, g_factors}: {m}")


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_linear_with_tokens_split_over_cp2_matches_one_process(recipe):
    run_ranks(2, _layer_worker, recipe)


def _trainer_worker(rank, world_size, out, recipe):
    dims = ParallelDims.from_degrees(cp=world_size)
    os.makedirs(os.path.join(out, "cp"), exist_ok=True)
    trainer = cp_trainer(LLAMA, os.path.join(out, "cp"), dims, precision="fp8", fp8_recipe=recipe)
    specs = [m.fp8 for m in trainer.model.modules() if getattr(m, "fp8", None) is not None]
    assert specs and all(s.cp_group is dims.cp_group for s in specs), "an fp8 linear does not reduce over cp"
    return [loss for loss, _ in losses_and_norms(trainer)]


@pytest.mark.parametrize("recipe", ["tensorwise", pytest.param("rowwise", marks=pytest.mark.slow)])
def test_fp8_trainer_at_cp2_follows_the_single_process_run(tmp_path, recipe):
    """The first step's fp8 operands are one process's (its loss differs by the round-off of cp's attention);
    later steps within fp8's curve tolerance, as tp's (tests/dist/test_fp8.py says why). This model's activations
    have no outliers, so a missing cp reduction rounds nothing differently here: the linears' test above is the
    one that fails it (each reduction dropped in turn fails it); this one checks the trainer wires cp_group."""
    os.makedirs(tmp_path / "single")
    single = cp_trainer(LLAMA, str(tmp_path / "single"), ParallelDims(), precision="fp8", fp8_recipe=recipe)
    reference = [loss for loss, _ in losses_and_norms(single)]
    losses = rank_results(2, _trainer_worker, str(tmp_path), recipe)[0]
    assert losses[0] == pytest.approx(reference[0], **FP8_TP_FIRST), (losses, reference)
    assert losses == pytest.approx(reference, **FP8_TP_CURVE), (losses, reference)
