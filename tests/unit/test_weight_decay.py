"""Weight decay's groups (pipetrain.optim.adamw.decays): matrices decay; norms, biases and the embeddings do not,
nor the copy of a tied embedding that the last pipeline stage holds as head.weight. Every other test compares
runs that share these groups (a layout against one process, ZeRO against zero 0, the parameter servers' replay
against decays itself), so decaying the norms and biases, or the embedding, passed the whole suite. Here one
AdamW step with zero gradients moves exactly the decayed parameters, each by lr x weight_decay, through the
optimizer a run builds (zero 0), and ZeRO puts the same parameters in its decayed group. And the recipe's
AdamW betas reach that optimizer."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipetrain.config import ParallelConfig, TrainConfig
from pipetrain.models import build, materialize
from pipetrain.optim.build import Optimizer
from pipetrain.parallel.data.zero import ZeroOptimizer
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.pipeline.stage import build_stage
from tests.unit.common import GPT2, LLAMA

LR, WD = 0.1, 0.5
CASES = {"llama": (LLAMA, 0), "qwen2-biases": (dataclasses.replace(LLAMA, family="qwen2"), 0),
         "gpt2-tied": (GPT2, 0), "gpt2-tied-last-stage": (GPT2, 1)}


def _model(cfg, pp_rank: int):
    """The whole model (pp_rank 0), or the last of 2 pipeline stages (pp_rank 1: its own head.weight copy)."""
    model = build(cfg, device="meta")
    if pp_rank:
        model, _, _ = build_stage(model, ParallelDims(pp=2, rank=pp_rank), ParallelConfig(pp=2, microbatches=2), 16)
    return materialize(model, cfg, 0, "cpu")


def _should_decay(model) -> set[str]:
    """The rule written out: 2-D weights of the blocks and an untied head; not the embeddings, norms or biases."""
    tied = model.cfg.tie_embeddings if model.cfg.tie_embeddings is not None else model.cfg.family == "gpt2"
    return {n for n, p in model.named_parameters()
            if p.dim() == 2 and n.split(".")[0] not in ("embed", "pos_embed") and not (tied and n == "head.weight")}


@pytest.mark.parametrize("case", list(CASES))
def test_one_step_with_zero_gradients_decays_the_matrices_only(case):
    cfg, pp_rank = CASES[case]
    model = _model(cfg, pp_rank)
    expected = _should_decay(model)
    names = {n for n, _ in model.named_parameters()}
    assert expected and expected < names and "layers.1.attn.wq.weight" in expected  # both kinds are present
    assert "norm.weight" in names - expected
    opt = Optimizer(model, ParallelDims(), TrainConfig(lr=LR, weight_decay=WD))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step(LR)
    decayed = set()
    for name, p in model.named_parameters():
        if not torch.equal(p.detach(), before[name]):
            torch.testing.assert_close(p.detach(), before[name] * (1 - LR * WD), rtol=1e-6, atol=0, msg=name)
            decayed.add(name)
    assert decayed == expected, (sorted(decayed - expected), sorted(expected - decayed))


@pytest.mark.parametrize("case", list(CASES))
def test_zero_puts_the_same_parameters_in_its_decayed_group(case):
    cfg, pp_rank = CASES[case]
    model = _model(cfg, pp_rank)
    opt = ZeroOptimizer(model, ParallelDims(), TrainConfig(lr=LR, weight_decay=WD), stage=1)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    in_group = [{id(v) for v in group["params"]} for group in opt.torch_opt.param_groups]
    assert [group["weight_decay"] for group in opt.torch_opt.param_groups] == [WD, 0.0]
    decayed = {names[i] for i, view in opt.views.items() if id(view) in in_group[0]}
    assert len(opt.views) == len(names) and decayed == _should_decay(model)


def test_the_run_s_adamw_takes_the_recipe_s_betas():
    """train.beta1 and train.beta2 reach the AdamW a run steps (every run compared elsewhere shares it, so betas
    fixed at torch's defaults passed the suite): two steps of the zero 0 optimizer against torch.optim.AdamW
    built by hand with the recipe's betas, eps 1e-8 and the decay groups above."""
    cfg = TrainConfig(lr=LR, weight_decay=WD, beta1=0.5, beta2=0.6)
    model = _model(LLAMA, 0)
    ref = _model(LLAMA, 0)
    decay = _should_decay(ref)
    named = dict(ref.named_parameters())
    torch_ref = torch.optim.AdamW([{"params": [named[n] for n in named if n in decay], "weight_decay": WD},
                                   {"params": [named[n] for n in named if n not in decay], "weight_decay": 0.0}],
                                  lr=LR, betas=(0.5, 0.6), eps=1e-8)
    opt = Optimizer(model, ParallelDims(), cfg)
    gen = torch.Generator().manual_seed(0)
    for step in range(2):
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            p.grad = torch.randn(p.shape, generator=gen) * (1 + step * 3)  # a changed scale: the moments matter
            q.grad = p.grad.clone()
        opt.step(LR)
        torch_ref.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
