"""The experts' float8 grouped GEMMs (pipetrain/parallel/tensor/fp8_experts.py) under tensor parallelism: tp
F-shards every expert, and each amax whose dim tp splits is reduced over tp, so tp=2 quantises exactly as one
process and the results differ by fp32 summation order only. Then a tiny MoE trained in fp8 at tp=2 against one
process (emulated fp8 on the CPU)."""
import os

import pytest
import torch
import torch.distributed as dist

from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.tensor import fp8_experts
from pipetrain.parallel.tensor.fp8_experts import Fp8Experts
from tests.dist.test_fp8 import _check_curve
from tests.harness import TP_FP32, rank_results, run_ranks
from tests.unit.common import build_trainer
from tests.unit.test_fp8_experts import MOE

STEPS = 4


def _summed(t: torch.Tensor, group) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


def _experts_worker(rank, world_size):
    """One grouped GEMM per tp split, against one process's, forward and backward. "in" (down: K split): rank 0's
    shard of x is 2^16 times rank 1's and its shard of W 2^-16 times, so both ranks' parts of y = x W^T count,
    while every amax over K comes from one rank's shard: a scale taken from one shard sends the other rank's values
    into e4m3's subnormals (or keeps them out where one process has them there). "out" (gate, up: N split): the
    same for dx = dy W with dy's shards and W's rows."""
    dims = ParallelDims.from_degrees(tp=world_size)
    E, M, N, K = 4, 24, 16, 32
    offs = torch.cumsum(torch.tensor([6, 0, 10, 8]), 0)
    for split in ("in", "out"):
        torch.manual_seed(0)
        x, w, dy = torch.randn(M, K), torch.randn(E, N, K), torch.randn(M, N)
        if split == "in":
            x[:, :K // 2] *= 2.0 ** 16
            w[:, :, :K // 2] *= 2.0 ** -16
            mine = slice(dims.tp_rank * K // 2, (dims.tp_rank + 1) * K // 2)
            xs, ws, dys = x[:, mine], w[:, :, mine], dy
        else:
            dy[:, :N // 2] *= 2.0 ** 16
            w[:, :N // 2] *= 2.0 ** -16
            mine = slice(dims.tp_rank * N // 2, (dims.tp_rank + 1) * N // 2)
            xs, ws, dys = x, w[:, mine], dy[:, mine]
        results = []
        for args in ((x, w, dy, Fp8Experts()), (xs, ws, dys, Fp8Experts(tp_group=dims.tp_group))):
            xi, wi = args[0].clone().requires_grad_(), args[1].clone().requires_grad_()
            y = args[3](xi, wi, offs, split)
            y.backward(args[2])
            results.append((y.detach(), xi.grad, wi.grad))
        (y_ref, dx_ref, dw_ref), (y, dx, dw) = results
        if split == "in":  # y partial over tp; dx and dW this rank's K slice
            pairs = {"y": (_summed(y, dims.tp_group), y_ref), "dx": (dx, dx_ref[:, mine]),
                     "dW": (dw, dw_ref[..., mine])}
        else:  # y this rank's N slice; dx partial over tp
            pairs = {"y": (y, y_ref[:, mine]), "dx": (_summed(dx, dims.tp_group), dx_ref), "dW": (dw, dw_ref[:, mine])}
        for what, (got, want) in pairs.items():
            torch.testing.assert_close(got, want, **TP_FP32, msg=lambda m: f"{dims.coords} {split} {what}: {m}")


def test_fp8_experts_at_tp2_quantise_as_one_process():
    run_ranks(2, _experts_worker)


def _losses(out: str, dims: ParallelDims | None = None) -> list[float]:
    os.makedirs(out, exist_ok=True)
    trainer = build_trainer(MOE, out, dims, precision="fp8", steps=STEPS, learnable=True)
    specs = [m.fp8_grouped for m in trainer.model.modules() if hasattr(m, "fp8_grouped")]
    tp_group = dims.tp_group if dims is not None and dims.tp > 1 else None
    assert len(specs) == MOE.n_layers and all(s.tp_group is tp_group for s in specs), specs
    return [trainer.train_step()["loss"] for _ in range(STEPS)]


def _trainer_worker(rank, world_size, out):
    return _losses(os.path.join(out, "run"), ParallelDims.from_degrees(tp=world_size))


def test_a_moe_trained_in_fp8_at_tp2_follows_the_single_process_run(tmp_path):
    reference = _losses(str(tmp_path / "single"))
    _check_curve(rank_results(2, _trainer_worker, str(tmp_path))[0], reference)


def _zero_worker(rank, world_size, out, zero):
    trainer = build_trainer(MOE, os.path.join(out, f"zero{zero}"), ParallelDims.from_degrees(dp=world_size),
                            precision="fp8", steps=STEPS, learnable=True, zero=zero)
    return [trainer.train_step()["loss"] for _ in range(STEPS)]


@pytest.mark.slow
def test_fp8_experts_under_zero3_equal_zero1(tmp_path):
    """ZeRO-3 gathers the stacked experts in fp32 (they are no bf16 linear) and the experts quantise them per
    expert as at zero 1: the same losses, bit for bit."""
    for zero in (1, 3):
        os.makedirs(tmp_path / f"zero{zero}")
    zero1, zero3 = (rank_results(2, _zero_worker, str(tmp_path), zero)[0] for zero in (1, 3))
    assert zero3 == zero1, (zero3, zero1)


def _layout_worker(rank, world_size, out, degrees):
    dims = ParallelDims.from_degrees(**degrees)
    os.makedirs(os.path.join(out, "run"), exist_ok=True)
    trainer = build_trainer(MOE, os.path.join(out, "run"), dims, precision="fp8", steps=STEPS, learnable=True,
                            ep=degrees.get("ep", 1))
    calls, real = [], fp8_experts.grouped_scaled_mm
    fp8_experts.grouped_scaled_mm = lambda *a: calls.append(1) or real(*a)  # (this spawned process's module)
    losses = [trainer.train_step()["loss"] for _ in range(STEPS)]
    # every layer's experts ran their y and dx GEMMs in fp8 on this rank, each step (fp8's loss is within
    # 1e-4 of bf16's at step 1 on this model: the curve alone would not tell)
    assert len(calls) == STEPS * MOE.n_layers * 6, (dims.coords, len(calls))
    return losses


@pytest.mark.parametrize("degrees", [dict(dp=2, ep=2), pytest.param(dict(cp=2), marks=pytest.mark.slow)],
                         ids=["ep2", "cp2"])
def test_a_moe_trained_in_fp8_under_ep_or_cp_follows_the_single_process_run(tmp_path, degrees):
    """ep: each rank's experts receive every row routed to them, so their scales per token and per expert channel
    are one process's. cp: no amax runs over tokens (dW is not quantised), so nothing is reduced over cp."""
    reference = _losses(str(tmp_path / "single"))
    _check_curve(rank_results(2, _layout_worker, str(tmp_path), degrees)[0], reference)
