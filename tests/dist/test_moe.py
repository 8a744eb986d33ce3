"""A mixture-of-experts model trained under tensor / pipeline / data parallelism matches one process at
every step: the loss, the aux loss, the gradient norm, the per-layer expert loads and the aux-free bias
(the router runs replicated outside the tp region, on the whole sequence under sequence parallelism; the
experts are F-sharded; counts are reduced over dp and pp)."""
import os

import pytest
import torch

from safetensors.torch import save_file

from pipetrain.config import ModelConfig
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.plan.memory import model_state_bytes, zero3_unit_bytes
from tests.dist.test_hf_parallel import _import_layout
from tests.harness import EXACT_FP32, TP_FP32, hf_configs, moe_hf_configs, run_ranks, save_tiny_hf, tokens
from tests.unit.common import build_trainer

MOE = ModelConfig(family="qwen3_moe", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  max_seq_len=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                  shared_expert_intermediate_size=16, router_aux_loss_coef=0.05, router_bias_update_rate=1e-3)
STEPS = 3
KEYS = ("loss", "aux_loss", "grad_norm")


def _run(out, dims=None, **parallel):
    os.makedirs(out, exist_ok=True)
    trainer = build_trainer(MOE, out, dims, steps=STEPS, global_batch=4, seq_len=16, **parallel)
    history = trainer.fit()
    bias = {i: b.mlp.router.expert_bias.clone() for i, b in trainer.model.layers.items()}
    return [{k: r[k] for k in KEYS + ("expert_load_max", "expert_load_mean")} for r in history], bias


def _worker(rank, world_size, out, degrees, parallel, expected, expected_bias, tol):
    dims = ParallelDims.from_degrees(**degrees)
    history, bias = _run(out, dims, **parallel)
    for step, (got, want) in enumerate(zip(history, expected), 1):
        for key in KEYS:
            torch.testing.assert_close(got[key], want[key], **tol, msg=f"{dims.coords} step {step} {key}")
        # the routing (and with it every count) is the same decision on every layout
        assert got["expert_load_max"] == want["expert_load_max"], f"{dims.coords} step {step} load"
    for i, b in bias.items():
        torch.testing.assert_close(b, expected_bias[i], rtol=0, atol=0, msg=f"{dims.coords} layer {i} bias")


@pytest.mark.parametrize("degrees, parallel, tol", [
    (dict(tp=2), {}, TP_FP32),
    # sequence parallelism: the router's logits gathered along T (every rank routes the whole sequence),
    # the experts' output reduce-scattered back to T/tp, the router weight's gradient summed over tp
    (dict(tp=2), dict(sequence_parallel=True), TP_FP32),
    pytest.param(dict(pp=2), dict(microbatches=2), EXACT_FP32, marks=pytest.mark.slow),  # aux injected on stages
    # context parallelism: each rank holds half of every sequence; the balance loss sums its counts over cp
    (dict(cp=2), {}, TP_FP32),
], ids=["tp2", "tp2-sp", "pp2", "cp2"])
def test_moe_training_matches_single_process(tmp_path, degrees, parallel, tol):
    expected, bias = _run(str(tmp_path / "one"), **parallel)
    run_ranks(2, _worker, str(tmp_path / "two"), degrees, parallel, expected, bias, tol)


@pytest.mark.slow
def test_moe_dp2_x_tp2_zero1_matches_single_process(tmp_path):
    expected, bias = _run(str(tmp_path / "one"))
    run_ranks(4, _worker, str(tmp_path / "four"), dict(dp=2, tp=2), dict(zero=1), expected, bias, TP_FP32)


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_hf_moe_imports_into_tp2_or_pp2_at_transformers_logits(tmp_path, tp, pp):
    """mixtral from transformers 5's fused expert tensors, qwen3_moe from the 4.x per-expert modules
    (what save_pretrained writes), each rank reading only its F/tp slice of every expert, or its stage's layers."""
    references = {}
    configs = dict(moe_hf_configs(), **({"gpt2": hf_configs()["gpt2"]} if pp > 1 else {}))  # pp also checks gpt2's pruned stage
    for name, cfg in configs.items():
        model = save_tiny_hf(cfg, str(tmp_path / name), seed=11)
        if name == "mixtral":
            save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                      str(tmp_path / name / "model.safetensors"), metadata={"format": "pt"})
        with torch.no_grad():
            references[name] = (str(tmp_path / name), model(tokens()).logits)
    run_ranks(2, _import_layout, tp, pp, references)



def _zero3_worker(rank, world_size, out, expected, expected_bias):
    """ZeRO-3 shards the stacked experts with the rest: a block holds its whole weights only while it runs (the
    bytes plan.memory models for its unit), the rows, gradients and moments are the model's 1/dp, and a
    checkpoint resumes bit for bit."""
    dims = ParallelDims.from_degrees(dp=world_size)
    trainer = build_trainer(MOE, out, dims, steps=STEPS, global_batch=4, seq_len=16, zero=3)
    opt = trainer.optimizer
    held = []
    for block in trainer.model.layers.values():
        block.register_forward_pre_hook(lambda m, a: held.append(
            sum(opt.gatherer.target(i).untyped_storage().nbytes() for i in range(len(opt.params)))))
    experts = [i for i, p in enumerate(opt.params) if p.dim() == 3]
    assert experts and all(opt.gatherer.target(i).untyped_storage().nbytes() == 0 for i in experts), \
        "the stacked experts are held whole between their unit's runs"
    history = []
    for step in range(STEPS):
        history.append(trainer.train_step())
        if step == STEPS - 2:
            trainer.checkpointer.save(trainer)
    resumed = build_trainer(MOE, out, dims, steps=STEPS, global_batch=4, seq_len=16, zero=3, resume="auto")
    assert resumed.train_step()["loss"] == history[-1]["loss"], "a zero 3 checkpoint of experts resumes exactly"
    assert sorted(set(held)) == [zero3_unit_bytes(trainer.recipe, 0)[1]], (held, zero3_unit_bytes(trainer.recipe, 0))
    assert opt.state_bytes() == model_state_bytes(trainer.recipe, world_size, 0)[2]
    for step, (got, want) in enumerate(zip(history, expected), 1):
        for key in KEYS:
            torch.testing.assert_close(got[key], want[key], **EXACT_FP32, msg=f"{dims.coords} step {step} {key}")
        assert got["expert_load_max"] == want["expert_load_max"], f"{dims.coords} step {step} load"
    for i, block in trainer.model.layers.items():
        torch.testing.assert_close(block.mlp.router.expert_bias, expected_bias[i], rtol=0, atol=0)


def test_moe_dp2_zero3_shards_the_experts_and_matches_single_process(tmp_path):
    expected, bias = _run(str(tmp_path / "one"))
    os.makedirs(tmp_path / "two")
    run_ranks(2, _zero3_worker, str(tmp_path / "two"), expected, bias)
