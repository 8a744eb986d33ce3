"""train.compile in one process: blocks compiled in place (names kept), parity with eager at every step under
full recompute and gradient-accumulation fusion, and under bf16 autocast, one graph for all blocks, the
backend knob, the reason inductor cannot run, the steady-state throughput of the end-of-run line, and the
split backward's dW deferred out of compiled blocks to the W action."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from pipetrain.config import ConfigError
from pipetrain.metrics import WARMUP_STEPS, steady_tokens_per_sec
from pipetrain.models import build
from pipetrain.models.compile import BACKEND_ENV, apply_compile, compile_backend, compile_problems
from pipetrain.parallel.pipeline.weight_grads import (apply_grad_accumulation_fusion, apply_weight_grads,
                                                      assign_work_keys, deferring, weight_grad_modules)
from tests.unit.common import GPT2, LLAMA, TINY_MOE, build_trainer


def _losses(tmp_path, name: str, steps: int = 3, model=LLAMA, **keys):
    out = tmp_path / name
    out.mkdir()
    trainer = build_trainer(model, str(out), steps=steps, microbatches=2, **keys)
    return trainer, [trainer.train_step()["loss"] for _ in range(steps)]


SIX_LAYERS = dataclasses.replace(LLAMA, n_layers=6)  # each layer's own recomputed forward made a graph apiece


@pytest.mark.parametrize("keys", [{"recompute": "full"}, {"precision": "bf16"}, {"model": GPT2},
                                  {"model": SIX_LAYERS, "recompute": "selective"},
                                  {"model": SIX_LAYERS, "recompute": "full"}],
                         ids=["fp32_recompute", "bf16", "gpt2", "selective_6_layers", "full_6_layers"])
def test_compiled_blocks_match_eager_at_every_step_and_compile_once(tmp_path, monkeypatch, keys):
    monkeypatch.setenv(BACKEND_ENV, "aot_eager")  # inductor's trace with eager kernels: bitwise, bf16 autocast too
    counters.clear()
    _, eager = _losses(tmp_path, "eager", **keys)
    assert not counters["stats"], "the eager run compiled something"
    torch._dynamo.reset()  # (each graph this test counts is traced here)
    trainer, compiled = _losses(tmp_path, "compiled", compile=True, **keys)
    assert compiled == eager, (compiled, eager)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # every block, 2 microbatches, 3 steps
    names = [n for n, _ in trainer.model.named_parameters()]
    assert "layers.0.attn.wq.weight" in names and not any("_orig_mod" in n for n in names), names
    assert all(block._compiled_call_impl is not None for block in trainer.model.layers.values())


MOE = TINY_MOE


@pytest.mark.parametrize("keys", [{}, {"recompute": "full"}, {"precision": "bf16"}],
                         ids=["fp32", "recompute_full", "bf16"])
def test_compiled_experts_match_eager_bit_for_bit_and_count_routing_once(tmp_path, monkeypatch, keys):
    """MoE blocks compile into one graph (the experts' GEMMs the op pipetrain::grouped_linear, whose host read of
    the counts stays inside it), and every step's loss, aux loss and expert loads, then every weight and the
    aux-free bias, equal eager's bit for bit. Under full recompute the checkpointed forward runs again in
    backward: the step's routing counts (a buffer the forward adds to) are taken once, as eager takes them."""
    monkeypatch.setenv(BACKEND_ENV, "aot_eager")
    runs = {}
    for name, compile_ in (("eager", False), ("compiled", True)):
        torch._dynamo.reset()
        counters.clear()
        (tmp_path / name).mkdir()
        trainer = build_trainer(MOE, str(tmp_path / name), steps=3, microbatches=2, compile=compile_, **keys)
        steps = [trainer.train_step() for _ in range(3)]
        runs[name] = ([(m["loss"], m["aux_loss"], m["expert_load_max"]) for m in steps], trainer.model)
        assert bool(counters["stats"]) == compile_
    (eager, eager_model), (compiled, model) = runs["eager"], runs["compiled"]
    assert compiled == eager, (compiled, eager)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    for (name, want), got in zip(eager_model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(got, want), name
    assert model.layers["1"].mlp.router.expert_bias.abs().sum() > 0  # the bias moved: counts reached it


def test_compile_backend_is_inductor_unless_the_test_knob_names_another(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert compile_backend() == "inductor"
    monkeypatch.setenv(BACKEND_ENV, "cudagraphs-please")
    with pytest.raises(ConfigError, match="PIPETRAIN_COMPILE_BACKEND='cudagraphs-please' is not one of"):
        compile_backend()


def test_inductor_on_cpu_without_a_cpp_compiler_is_a_problem_with_the_fix():
    import torch._inductor.config as inductor_config  # deferred as in pipetrain.models.compile: heavy
    assert compile_problems(torch.device("cpu"), "aot_eager") == []  # no C++ needed without inductor
    with inductor_config.patch({"cpp.cxx": ("/nonexistent/g++",)}):  # not monkeypatch: see tests/e2e/test_compile.py
        problems = compile_problems(torch.device("cpu"), "inductor")
    assert len(problems) == 1 and "needs a C++ compiler" in problems[0] and "/nonexistent/g++" in problems[0] \
        and "set train.compile=false" in problems[0], problems


def test_steady_state_is_the_median_after_the_warm_up_steps():
    assert WARMUP_STEPS == 2
    rates = [5.0, 900.0, 1000.0, 1200.0, 1100.0, 10.0]  # a compile step, a recompile, then one slow step
    assert steady_tokens_per_sec(rates) == 1050.0  # median of the last 4, not the mean (827.5)
    assert steady_tokens_per_sec(rates[:2]) is None


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise",
                                    pytest.param("rowwise_with_gw_hp", marks=pytest.mark.slow)])
def test_fp8_linears_stay_fp8_inside_compiled_blocks(tmp_path, monkeypatch, recipe):
    """linear() hands fp8 modules to Fp8Linear before the compiled shortcut to F.linear, so a compiled fp8
    run's first loss is eager fp8's bit for bit (a bf16 forward gives another); later steps follow eager fp8
    within 1e-3 (aot_eager's traced backward rounds a few gradients differently). rowwise: its per-row
    amaxes and casts trace into the blocks' one graph too (fullgraph), and it has no weight cache."""
    monkeypatch.setenv(BACKEND_ENV, "aot_eager")
    _, eager = _losses(tmp_path, "eager", precision="fp8", fp8_recipe=recipe)
    _, bf16 = _losses(tmp_path, "bf16", precision="bf16")
    torch._dynamo.reset()  # (a compiled quantisation of these weight shapes from an earlier test would be reused)
    counters.clear()
    trainer, compiled = _losses(tmp_path, "compiled", precision="fp8", compile=True, fp8_recipe=recipe)
    # the blocks' one graph, and the tensorwise weight cache's quantisation (2 microbatches), one per weight shape
    shapes = {tuple(m.weight.shape) for m in trainer.model.modules() if getattr(m, "fp8", None) is not None}
    cache_graphs = len(shapes) if recipe == "tensorwise" else 0
    assert counters["stats"]["unique_graphs"] == 1 + cache_graphs, dict(counters["stats"])
    assert bf16[0] != eager[0], "the fp8 forward must differ from bf16's for this test to mean anything"
    assert compiled[0] == eager[0] and compiled == pytest.approx(eager, rel=1e-3), (compiled, eager)


def _blocks_backward(model, x, dy, modules=None, work=None, autocast=False):
    """Run model.layers on x and backward dy, inside deferring(modules, work) when given."""
    with deferring(modules, work) if modules is not None else torch.enable_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            h = x
            for block in model.layers.values():
                h = block(h)
        h.backward(dy.to(h.dtype))


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_a_split_backward_defers_dw_out_of_compiled_blocks_to_the_w_action(autocast):
    """Under a split backward a compiled block's linears defer dW as eager ones do: B computes no dW (.grad
    stays empty; the graph's edge to each weight fires its hook with nothing added), the W action
    (apply_weight_grads) adds dW and fires each hook once with it; gradients equal the eager blocks' bit
    for bit (aot_eager; fp32 and bf16 autocast), and every block shares one graph."""
    torch.manual_seed(0)
    eager, compiled = build(LLAMA, "cpu"), build(LLAMA, "cpu")
    compiled.load_state_dict(eager.state_dict())
    for model in (eager, compiled):
        apply_grad_accumulation_fusion(model, None)  # WeightGradLinears, fusion off, as build_trainer does
    counters.clear()
    apply_compile(compiled, backend="aot_eager")
    modules = assign_work_keys(weight_grad_modules(compiled.layers))  # the executor does this under a split
    x, dy = torch.randn(2, 8, LLAMA.d_model), torch.randn(2, 8, LLAMA.d_model)
    _blocks_backward(eager, x.clone().requires_grad_(), dy, autocast=autocast)
    linears = {n: p for n, p in compiled.layers.named_parameters() if "norm" not in n}
    fired = []
    for name, p in linears.items():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.append((name, p.grad is not None)))
    work = []
    _blocks_backward(compiled, x.clone().requires_grad_(), dy, modules, work, autocast)  # B
    assert len(work) == 7 * LLAMA.n_layers, len(work)  # every linear of every block deferred
    assert all(p.grad is None for p in linears.values()) and not any(has for _, has in fired), fired
    fired.clear()
    apply_weight_grads(work)  # W
    assert sorted(fired) == sorted((name, True) for name in linears), fired
    for (name, p), (_, q) in zip(compiled.layers.named_parameters(), eager.layers.named_parameters()):
        assert torch.equal(p.grad, q.grad), name
    # no deferral around it (a microbatch without a W action): dW is added in B, to the same sum again
    _blocks_backward(compiled, x.clone().requires_grad_(), dy, autocast=autocast)
    for (name, p), (_, q) in zip(compiled.layers.named_parameters(), eager.layers.named_parameters()):
        assert torch.equal(p.grad, 2 * q.grad), name
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # deferring() caused no recompile
