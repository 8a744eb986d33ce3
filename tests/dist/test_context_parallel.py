"""Context parallelism (parallel.cp) on gloo CPU processes, against the same run in one process.

Every case trains a few fp32 steps and checks the loss and the global gradient norm at every step, then the
validation loss (the loader slices validation batches too), against the single-process run (the norm catches
a wrong gradient at the first step, before the loss could drift).
In the default run, cp 2 only: plain causal llama and a mistral sliding window with document masks, ZeRO 1
and LoRA, compiled blocks; the rest of the matrix (cp 4, cp x tp, cp x dp, cp x pp, ZeRO 2/3, cp x dp with
ZeRO, a second compiled model) is marked slow.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from pipetrain.build import build_trainer
from pipetrain.config import DataConfig, ModelConfig, ParallelConfig, Recipe, RunConfig, TrainConfig
from pipetrain.data import Loader, PackedData
from pipetrain.models.compile import BACKEND_ENV
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.plan.memory import activation_bytes as planned_activation_bytes, model_state_bytes
from tests.harness import TP_FP32, run_ranks, saved_activation_bytes

STEPS, SEQ, BATCH = 3, 32, 4
LLAMA = ModelConfig(family="llama", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    ffn_hidden=64, max_seq_len=64)  # GQA: 2 kv heads gathered over cp
MISTRAL = ModelConfig(family="mistral", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      ffn_hidden=64, max_seq_len=64, sliding_window=6)  # window shorter than a cp chunk at cp 2
GPT2 = ModelConfig(family="gpt2", vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=64)  # learned positions
LORA = ModelConfig(**{**LLAMA.__dict__, "lora_rank": 4, "lora_alpha": 8.0})  # adapters train, the base is frozen
MOE = ModelConfig(**{**LLAMA.__dict__, "family": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                     "moe_intermediate_size": 24, "router_aux_loss_coef": 0.01})  # per-sequence balance over cp
MODELS = {"llama": LLAMA, "mistral": MISTRAL, "gpt2": GPT2, "lora": LORA, "moe": MOE}


def cp_trainer(cfg: ModelConfig, out: str, dims: ParallelDims, *, document_mask: bool = False, steps: int = STEPS,
               seq_len: int = SEQ, resume: str | None = None, **parallel):
    """build_trainer on random tokens cut into documents of 3..20 tokens (several boundaries in every window
    and in every cp chunk), with data.document_mask when asked."""
    train = {k: parallel.pop(k) for k in ("compile", "precision", "fp8_recipe", "fused_loss") if k in parallel}
    recipe = Recipe(model=cfg, parallel=ParallelConfig(tp=dims.tp, pp=dims.pp, cp=dims.cp, **parallel),
                    train=TrainConfig(steps=steps, global_batch=BATCH, seq_len=seq_len, lr=1e-2, min_lr=1e-3,
                                      warmup_steps=1, grad_clip=1.0, **train),
                    data=DataConfig(document_mask=document_mask),
                    run=RunConfig(output_dir=out, progress=False, eval_batches=1))
    rng = np.random.default_rng(0)
    num = 48 * (seq_len + 1)
    tokens = rng.integers(0, cfg.vocab_size, num).astype(np.int32)
    cuts = np.cumsum(rng.integers(3, 21, num))
    documents = np.concatenate([[0], cuts[cuts < num], [num]]).astype(np.int64)
    data = PackedData(tokens, None, seq_len, 0.1, 2, documents=documents, document_mask=document_mask)
    return build_trainer(recipe, dims, resume=resume, loader=Loader(data, BATCH, dims.dp_rank, dims.dp))


def losses_and_norms(trainer, steps: int = STEPS, evaluate: bool = False) -> list[tuple[float, float]]:
    """(loss, grad norm) of each step; evaluate: then (validation loss, 0.0), the loader's sliced val batches."""
    out = []
    for _ in range(steps):
        record = trainer.train_step()
        out.append((record["loss"], record["grad_norm"]))
    if evaluate:
        out.append((trainer.evaluate()["eval_loss"], 0.0))
    return out


def reference(out: str, model: str, document_mask: bool, steps: int = STEPS, **parallel) -> list[tuple[float, float]]:
    """The single-process run, in this process."""
    os.makedirs(out, exist_ok=True)
    trainer = cp_trainer(MODELS[model], out, ParallelDims(), document_mask=document_mask, steps=steps, **parallel)
    return losses_and_norms(trainer, steps, evaluate=True)


def _cases_worker(rank, world_size, out, degrees, cases, expected):
    dims = ParallelDims.from_degrees(**degrees)
    for (model, document_mask, parallel), want in zip(cases, expected):
        name = f"{model}-docs{int(document_mask)}"
        os.makedirs(os.path.join(out, name), exist_ok=True)
        trainer = cp_trainer(MODELS[model], os.path.join(out, name), dims, document_mask=document_mask, **parallel)
        if parallel.get("zero"):  # ZeRO shards over dp x cp: a parity that held with no sharding proves nothing
            assert trainer.optimizer.dp_size == dims.dp * dims.cp, (dims.coords, trainer.optimizer.dp_size)
        graphs = counters["stats"]["unique_graphs"]
        got = losses_and_norms(trainer, evaluate=True)
        # the planner's ZeRO state: rows of dp x cp shards (plan.memory does not model LoRA's frozen base)
        if parallel.get("zero") and dims.zero_shard_rank == 0 and model != "lora":
            predicted = model_state_bytes(trainer.recipe, dims.world_size, dims.pp_rank)[2]
            assert trainer.optimizer.state_bytes() == predicted, (dims.coords, name, predicted)
        if parallel.get("fused_loss"):  # the head runs inside the loss: the last chunk stops at the final norm
            assert all(getattr(chunk, "head", None) is None for chunk in trainer.executor.chunks), name
        if parallel.get("compile"):  # the blocks (and the cp core in them) ran compiled, one graph serving both
            # blocks in training and one the no-grad evaluation: no recompilation from step to step
            after = counters["stats"]["unique_graphs"]
            assert graphs < after <= graphs + 2, f"{dims.coords} {name}: {after - graphs} graph(s) compiled"
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TP_FP32,
                                   msg=lambda m: f"{dims.coords} {name} {degrees} (loss, grad norm) per step, then "
                                             f"the validation loss: {m}")


def check_cases(tmp_path, degrees: dict, cases: list[tuple[str, bool, dict]]) -> None:
    """Each case (model, document_mask, extra parallel keys) on the degrees' world gives the single-process
    losses and gradient norms at every step."""
    expected = [reference(str(tmp_path / f"ref{i}"), m, d, **{k: v for k, v in p.items() if k == "microbatches"})
                for i, (m, d, p) in enumerate(cases)]
    world = 1
    for v in degrees.values():
        world *= v
    run_ranks(world, _cases_worker, str(tmp_path / "cp"), degrees, cases, expected)


def test_cp2_matches_single_process_causal_and_document_masked_sliding_window(tmp_path):
    check_cases(tmp_path, {"cp": 2}, [("llama", False, {}), ("mistral", True, {})])


@pytest.mark.slow
def test_cp4_matches_single_process(tmp_path):
    check_cases(tmp_path, {"cp": 4}, [("llama", True, {}), ("mistral", False, {}), ("gpt2", False, {})])


@pytest.mark.slow
def test_cp2_tp2_matches_single_process_with_and_without_sequence_parallelism(tmp_path):
    check_cases(tmp_path, {"cp": 2, "tp": 2}, [("llama", True, {"sequence_parallel": True}),
                                                ("mistral", False, {})])


@pytest.mark.slow
def test_cp2_dp2_matches_single_process(tmp_path):
    check_cases(tmp_path, {"cp": 2, "dp": 2}, [("llama", False, {}), ("mistral", True, {})])


@pytest.mark.slow
def test_cp2_pp2_matches_single_process_with_selective_recompute(tmp_path):
    check_cases(tmp_path, {"cp": 2, "pp": 2}, [("llama", True, {"microbatches": 2, "recompute": "selective"}),
                                                ("gpt2", False, {"microbatches": 2})])


# ---- ZeRO and LoRA: ZeRO shards over dp x cp (ParallelDims.zero_shard), one reduce-scatter summing over both ----
def test_cp2_with_zero_1_and_lora_matches_single_process(tmp_path):
    """dp 1: the ZeRO shard group is the cp group itself (each cp rank owns half the rows)."""
    check_cases(tmp_path, {"cp": 2}, [("llama", True, {"zero": 1}), ("lora", False, {})])


@pytest.mark.slow
def test_cp2_with_zero_2_and_3_matches_single_process(tmp_path):
    check_cases(tmp_path, {"cp": 2}, [("mistral", True, {"zero": 2}), ("llama", True, {"zero": 3})])


@pytest.mark.slow
def test_cp2_dp2_with_zero_and_lora_matches_single_process(tmp_path):
    """dp 2 x cp 2: the shard group is all four ranks (dp_cp_group)."""
    check_cases(tmp_path, {"cp": 2, "dp": 2}, [("llama", True, {"zero": 1}), ("mistral", False, {"zero": 2}),
                                                ("llama", False, {"zero": 3}), ("lora", True, {"zero": 2})])


# ---- compile: the cp attention core traced with fullgraph (aot_eager: inductor's trace, eager kernels) ----
@pytest.mark.parametrize("model, document_mask", [("llama", True),
                                                  pytest.param("mistral", False, marks=pytest.mark.slow),
                                                  pytest.param("moe", True, marks=pytest.mark.slow)])
def test_cp2_compiled_matches_single_process(tmp_path, monkeypatch, model, document_mask):
    monkeypatch.setenv(BACKEND_ENV, "aot_eager")  # spawned ranks inherit it
    check_cases(tmp_path, {"cp": 2}, [(model, document_mask, {"compile": True})])


# ---- the fused head + loss (train.fused_loss): token-local, a loss sum over this rank's tokens as the unfused ----
def test_cp2_with_the_fused_loss_matches_the_unfused_single_process(tmp_path):
    check_cases(tmp_path, {"cp": 2}, [("llama", True, {"fused_loss": True})])


# ---- activation memory falls with cp ----
LONG = 256
# one kv head: each rank keeps the whole sequence's K and V, which GQA keeps small
LONG_LLAMA = ModelConfig(**{**LLAMA.__dict__, "max_seq_len": LONG, "n_kv_heads": 1})


def activation_bytes(trainer) -> int:
    """Bytes one forward of this rank's first batch keeps for backward (tests.harness.saved_activation_bytes:
    distinct storages, parameters left out): the activations that grow with the sequence."""
    batch, _ = trainer.loader.next()
    return saved_activation_bytes(trainer.model, batch.inputs, batch.targets, positions=batch.positions)


def _memory_worker(rank, world_size, out, single_bytes, most):
    dims = ParallelDims.from_degrees(cp=world_size)
    os.makedirs(out, exist_ok=True)
    got = activation_bytes(cp_trainer(LONG_LLAMA, out, dims, seq_len=LONG))
    assert got <= most * single_bytes, f"{dims.coords} cp={world_size} keeps {got} activation bytes, " \
        f"{got / single_bytes:.2f}x cp 1's {single_bytes}; expected at most {most}x"


@pytest.mark.parametrize("cp, most", [(2, 0.6), pytest.param(4, 0.35, marks=pytest.mark.slow)])
def test_per_rank_activation_memory_falls_with_cp(tmp_path, cp, most):
    single = activation_bytes(cp_trainer(LONG_LLAMA, str(tmp_path), ParallelDims(), seq_len=LONG))
    run_ranks(cp, _memory_worker, str(tmp_path / "cp"), single, most)


# ---- the planner's memory model at cp 2 ----
def _planned_memory_worker(rank, world_size, out, cases):
    dims = ParallelDims.from_degrees(cp=world_size)
    for recompute, model in cases:
        os.makedirs(os.path.join(out, recompute), exist_ok=True)
        trainer = cp_trainer(model, os.path.join(out, recompute), dims, seq_len=LONG, recompute=recompute)
        measured = activation_bytes(trainer)
        predicted = planned_activation_bytes(trainer.recipe, world_size, 0, in_flight=1)
        # 5%, tighter than the single-process tests' 15%: the model is within 1% here, and 15% would pass
        # without the gathered K/V (their share of a block is ~10% at cp 2)
        assert abs(predicted - measured) <= 0.05 * measured, \
            f"{dims.coords} recompute={recompute}: planned {predicted} activation bytes, measured {measured}"


def test_planned_activation_bytes_at_cp2_within_15_percent_of_saved_tensors(tmp_path):
    """plan.memory (what the pre-flight check, --dry-run and parallel.auto report) against the tensors a cp 2
    rank's forward keeps: the slice's tokens, the gathered K/V, selective and full recompute."""
    gqa = ModelConfig(**{**LONG_LLAMA.__dict__, "n_kv_heads": 2})
    mha = ModelConfig(**{**LONG_LLAMA.__dict__, "n_kv_heads": 4})  # the gathered K/V: ~10% of a block at cp 2
    run_ranks(2, _planned_memory_worker, str(tmp_path), [("none", LONG_LLAMA), ("none", mha), ("selective", gqa),
                                                          ("full", gqa)])


# ---- checkpoints are cp-free ----
def save_after_two_steps(out: str, dims: ParallelDims, **parallel) -> None:
    """Train steps 1-2 of the 4-step run (the LR schedule is the 4-step one) and save at step 2."""
    trainer = cp_trainer(LLAMA, out, dims, steps=4, document_mask=True, **parallel)
    losses_and_norms(trainer, 2)
    trainer.logger.save_checkpoint(trainer.checkpointer, trainer)
    trainer.checkpointer.wait()


def _resume_worker(rank, world_size, out, expected, zero):
    dims = ParallelDims.from_degrees(cp=2)
    save_after_two_steps(os.path.join(out, "saved_at_cp2"), dims, zero=zero)
    resumed = cp_trainer(LLAMA, os.path.join(out, "saved_at_cp1"), dims, steps=4, document_mask=True, resume="auto",
                         zero=zero)
    assert resumed.step == 2, f"{dims.coords} resumed at step {resumed.step}"
    torch.testing.assert_close(torch.tensor(losses_and_norms(resumed, 2)), torch.tensor(expected[2:4]), **TP_FP32,
                               msg=lambda m: f"{dims.coords} cp 2 resuming a cp 1 checkpoint: {m}")


@pytest.mark.parametrize("zero", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_a_cp2_checkpoint_resumes_at_cp1_and_the_reverse_with_the_same_next_losses(tmp_path, zero):
    """zero: the cp 2 side's ZeRO stage (its AdamW moments, and at 3 its weights, are row shards over the cp
    pair); the cp 1 side runs zero 0."""
    out = str(tmp_path)
    expected = reference(os.path.join(out, "uninterrupted"), "llama", True, steps=4)
    os.makedirs(os.path.join(out, "saved_at_cp1"))
    os.makedirs(os.path.join(out, "saved_at_cp2"))
    save_after_two_steps(os.path.join(out, "saved_at_cp1"), ParallelDims())
    run_ranks(2, _resume_worker, out, expected, zero)
    resumed = cp_trainer(LLAMA, os.path.join(out, "saved_at_cp2"), ParallelDims(), steps=4, document_mask=True,
                         resume="auto")
    assert resumed.step == 2
    torch.testing.assert_close(torch.tensor(losses_and_norms(resumed, 2)), torch.tensor(expected[2:4]), **TP_FP32,
                               msg=lambda m: f"cp 1 resuming a cp 2 checkpoint: {m}")


# ---- the step on the device (clip_and_step) under cp with ZeRO: the norm sums its rows' squares over dp x cp ----
def _on_device_run(out: str, dims: ParallelDims, zero: int) -> list[tuple[float, float]]:
    """(loss, grad norm) per step of cp_trainer on the fused-AdamW path CUDA takes by default (clip_and_step);
    the CPU's foreach AdamW takes the host path (clip_grad_norm), so only this forces the device path here."""
    import pipetrain.optim.adamw as adamw
    adamw.FUSED_DEVICES = ("cuda", "cpu")  # in a worker; the test's own process sets it through monkeypatch
    os.makedirs(out, exist_ok=True)
    trainer = cp_trainer(LLAMA, out, dims, document_mask=True, zero=zero)
    assert trainer.optimizer.steps_on_device, type(trainer.optimizer).__name__
    return losses_and_norms(trainer)


def _on_device_worker(rank, world_size, out, zero):
    return _on_device_run(os.path.join(out, "cp"), ParallelDims.from_degrees(cp=world_size), zero)


@pytest.mark.parametrize("zero", [1, 3])
def test_cp2_zero_step_on_the_device_gives_the_single_process_losses_and_norms(tmp_path, monkeypatch, zero):
    """ZeRO under cp shards the gradient rows over dp x cp (here the cp pair): clip_and_step's norm must sum the
    squares over that group, as clip_grad_norm does (test_cp2_with_zero_1_and_lora checks the host path)."""
    import pipetrain.optim.adamw as adamw
    from tests.harness import rank_results
    monkeypatch.setattr(adamw, "FUSED_DEVICES", ("cuda", "cpu"))
    want = _on_device_run(str(tmp_path / "one"), ParallelDims(), 0)
    for got in rank_results(2, _on_device_worker, str(tmp_path), zero):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TP_FP32,
                                   msg=lambda m: f"cp 2 zero {zero} on the device (loss, grad norm) per step: {m}")
