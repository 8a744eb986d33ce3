"""Expert parallelism's gradients of the experts themselves, and the experts' share of the gradient norm, against
one process. tests/dist/test_expert_parallel.py sees them only through the loss (AdamW hardly changes when a whole
tensor's gradient is scaled) and the norm (the experts are ~2e-4 of the squared norm of tests/dist/test_moe.py's
MOE, below TP_FP32's tolerance): a mutation audit (2026-11-28) found two bugs of 22 it missed, an ep x tp x
sequence-parallel x ZeRO-1 layout summing tp-partial expert gradients over tp twice, and the experts' squares
counted as tp-replicated in the norm. Each test here fails at step 1 on those and on the expert reductions
over the wrong group or by the wrong count.

1. test_expert_grad_norm_counts_every_expert_shard_once: gradients set by hand (every parameter's slice of one
   full-model gradient, the experts' 100x the rest), so the norm is mostly the experts': the zero-0 norm
   (GradNormGroups over ep and tp) must be one process's, on every rank, and clipping must scale the experts.
2. test_ep_expert_grads_match_single_process: each rank's expert gradient (zero 0: p.grad; ZeRO: its rows) after
   every step against the single-process (clipped) gradient, under cp (TP_FP32) and expert-dp 2.
3. the ep x tp x sequence-parallel x ZeRO-1 layout (ExpertZeroOptimizer's expert part must not sync tp again).
"""
from __future__ import annotations

import os

import pytest
import torch

from pipetrain.models import param_layout
from pipetrain.models.moe import Experts
from pipetrain.parallel.mesh.dims import ParallelDims
from tests.dist.test_expert_parallel import STEPS, _box, _reference, _run, _worker
from tests.dist.test_moe import MOE
from tests.harness import EXACT_FP32, TP_FP32, run_ranks
from tests.unit.common import build_trainer


def _full_grads(model) -> dict[str, torch.Tensor]:
    """One full-model gradient, the same on every rank: randn per global parameter, the experts' x100."""
    experts = {f"{n}.{p}" for n, m in model.named_modules() if isinstance(m, Experts) for p in ("gate", "up", "down")}
    out = {}
    for i, (name, (shape, _)) in enumerate(sorted(param_layout(model).items())):
        g = torch.randn(shape, generator=torch.Generator().manual_seed(i))
        out[name] = g * 100.0 if name in experts else g
    return out


def _norm_worker(rank, world_size, out, degrees):
    dims = ParallelDims.from_degrees(**degrees)
    trainer = build_trainer(MOE, out, dims, steps=1, global_batch=4, seq_len=16, ep=dims.ep)
    model, opt = trainer.model, trainer.optimizer
    full = _full_grads(model)
    want = torch.sqrt(sum(g.double().square().sum() for g in full.values())).item()
    params = dict(model.named_parameters())
    for name, (_, slices) in param_layout(model).items():
        params[name].grad = full[name][slices].clone()
    norm = opt.clip_grad_norm(want / 2)
    torch.testing.assert_close(norm, want, rtol=1e-6, atol=0, msg=lambda m: f"{dims.coords} the global norm: {m}")
    coef = (want / 2) / (norm + 1e-6)
    for name, (_, slices) in param_layout(model).items():  # clipping scaled every gradient, the experts too
        torch.testing.assert_close(params[name].grad, full[name][slices] * coef, rtol=1e-6, atol=0,
                                   msg=lambda m: f"{dims.coords} {name} clipped: {m}")


@pytest.mark.parametrize("degrees", [dict(dp=4, ep=2), dict(dp=2, ep=2, tp=2), dict(dp=2, cp=2, ep=2)],
                         ids=["ep2-dp4", "ep2-tp2", "ep2-cp2"])
def test_expert_grad_norm_counts_every_expert_shard_once(tmp_path, degrees):
    run_ranks(4, _norm_worker, str(tmp_path), degrees)


def _grads_worker(rank, world_size, out, degrees, parallel, expected, tol):
    history, grads, _, _ = expected
    dims = ParallelDims.from_degrees(**degrees)
    trainer = build_trainer(MOE, out, dims, steps=STEPS, global_batch=4, seq_len=16, ep=dims.ep, **parallel)
    opt, layout = trainer.optimizer, param_layout(trainer.model)
    experts = {id(p) for m in trainer.model.modules() if isinstance(m, Experts) for p in m.parameters()}
    for step in range(STEPS):
        got = trainer.train_step()
        torch.testing.assert_close(got["loss"], history[step]["loss"], **tol, msg=f"{dims.coords} step {step + 1}")
        checked = 0
        if hasattr(opt, "parts"):  # ExpertZeroOptimizer: this rank's rows of the expert part
            for i, g in opt.experts._grad_shards.items():
                shard = opt.experts.shards[i]
                want = _box(grads[step][shard.name], *shard.box(opt.experts.dp_rank))
                torch.testing.assert_close(
                    g, want, **tol, msg=lambda m: f"{dims.coords} step {step + 1} {shard.name} rows: {m}")
                checked += 1
        else:  # zero 0: the whole local expert gradient
            for name, p in trainer.model.named_parameters():
                if id(p) in experts:
                    want = grads[step][name][layout[name][1]]
                    torch.testing.assert_close(
                        p.grad, want, **tol, msg=lambda m: f"{dims.coords} step {step + 1} {name}: {m}")
                    checked += 1
        assert checked, f"{dims.coords} no expert gradient was compared"


@pytest.mark.parametrize("degrees, parallel, tol", [
    (dict(dp=4, ep=2), {}, EXACT_FP32),  # expert-dp 2: the experts' own all-reduce
    (dict(dp=2, cp=2, ep=2), {}, TP_FP32),  # the experts' replicas are the cp group
    (dict(dp=2, cp=2, ep=2), dict(zero=1), TP_FP32),  # ExpertZeroOptimizer over expert-dp x cp
], ids=["ep2-dp4", "ep2-cp2", "ep2-cp2-zero1"])
def test_ep_expert_grads_match_single_process(tmp_path, degrees, parallel, tol):
    expected = _reference(str(tmp_path / "one"))
    os.makedirs(tmp_path / "many")
    run_ranks(4, _grads_worker, str(tmp_path / "many"), degrees, parallel, expected, tol)


def test_ep2_tp2_sp_zero1_matches_single_process(tmp_path):
    """ep x tp x sequence parallelism under ZeRO 1 (ExpertZeroOptimizer with tp-partial norms): no other test ran it."""
    parallel = dict(zero=1, sequence_parallel=True)
    expected = _run(str(tmp_path / "one"), sequence_parallel=True)
    run_ranks(4, _worker, str(tmp_path / "many"), dict(dp=2, ep=2, tp=2), parallel, expected, TP_FP32)
