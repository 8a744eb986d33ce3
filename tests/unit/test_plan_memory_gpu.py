"""The memory model on a GPU: the Triton kernels' path, bf16, fp8 and the fused loss, against the peaks an H200
measured (benchmarks/gpu.py, third GPU run in docs/benchmarks.md), and the pre-flight check of a run on a card
that PIPETRAIN_DEVICE names.

The CPU tests check the model in fp32 against the tensors autograd saves (test_plan_memory.py); this machine
cannot measure a CUDA run, so the figures below are the H200's, each the peak allocated GiB of one row of one
run (one process, seq 2048, 16 sequences, bf16 autocast over fp32 masters unless the row says fp8). The model
must stay within the pre-flight check's MARGIN of each: the check refuses a run only when its estimate less
MARGIN exceeds the card, so a model 2.3x over (fp8, before it knew the Triton path and fp8's float8 inputs)
refused runs that fit.
"""
from __future__ import annotations

import pytest
import torch

from pipetrain.config import ConfigError, ModelConfig, ParallelConfig, Recipe, TrainConfig
from pipetrain.models import build, materialize
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.pipeline.recompute import apply_recompute
from pipetrain.parallel.pipeline.weight_grads import apply_grad_accumulation_fusion
from pipetrain.parallel.tensor.fp8 import apply_fp8
from pipetrain.plan.memory import activation_bytes, rank_memory, saved_bytes_per_token
from pipetrain.plan.precision import fp8_linear_input_savings
from pipetrain.preflight import MARGIN, check_model_fits

LLAMA_1B = dict(family="llama", vocab_size=8192, d_model=2048, n_layers=16, n_heads=16, n_kv_heads=8,
                ffn_hidden=8192, max_seq_len=2048, tie_embeddings=False)
GPT_1B = dict(family="gpt2", vocab_size=50304, d_model=2048, n_layers=24, n_heads=16, max_seq_len=2048,
              tie_embeddings=True)
LLAMA_1B5 = dict(LLAMA_1B, vocab_size=128256)
BF16, FP8 = {"precision": "bf16"}, {"precision": "fp8"}
# (model, train keys, the H200's peak allocated GiB; docs/benchmarks.md, "Third GPU run", 2026-11-28)
H200_PEAKS = [
    (GPT_1B, BF16, 76.0),
    (GPT_1B, {**BF16, "compile": True}, 75.3),
    (GPT_1B, {**FP8, "compile": True}, 55.0),  # the second run's (2026-11-27): the third's step ran out first
    (LLAMA_1B, BF16, 55.6),
    (LLAMA_1B, {**BF16, "compile": True}, 57.5),
    (LLAMA_1B, {**FP8, "compile": True}, 49.9),
    (LLAMA_1B, FP8, 51.8),
    (LLAMA_1B5, {**BF16, "fused_loss": False}, 76.9),
    (LLAMA_1B5, {**BF16, "fused_loss": True}, 61.7),
]


def recipe_of(model: dict, train: dict, sequences: int = 16) -> Recipe:
    return Recipe(model=ModelConfig(**model), parallel=ParallelConfig(),
                  train=TrainConfig(global_batch=sequences, seq_len=2048, **train))


@pytest.mark.parametrize("model,train,measured", H200_PEAKS,
                         ids=[f"{m['family']}-{m['vocab_size']}-{'-'.join(f'{k}={v}' for k, v in t.items())}"
                              for m, t, _ in H200_PEAKS])
def test_cuda_estimate_within_the_preflight_margin_of_the_h200s_measured_peak(monkeypatch, model, train, measured):
    monkeypatch.delenv("PIPETRAIN_KERNELS", raising=False)  # the Triton kernels, as the H200's rows ran
    (rank,) = rank_memory(recipe_of(model, train), 1, device_type="cuda")
    predicted = rank.total / 2**30
    assert abs(predicted / measured - 1) <= MARGIN, f"predicted {predicted:.1f} GiB, the H200 measured {measured}"


def test_cuda_estimate_counts_what_the_triton_path_and_fp8_and_the_fused_loss_keep(monkeypatch):
    """Each of the GPU's differences moves the estimate the way the kernels do (the sizes: the test above)."""
    monkeypatch.delenv("PIPETRAIN_KERNELS", raising=False)

    def total(model, train, staged=False):
        return rank_memory(recipe_of(model, train), 1, staged_collectives=staged,
                           device_type="cpu" if staged else "cuda")[0]

    cuda, cpu = total(LLAMA_1B, BF16), total(LLAMA_1B, BF16, staged=True)
    assert cuda.activations < cpu.activations  # the SwiGLU kernel keeps gate and up, not silu(gate) too
    assert cuda.loss_temp < cpu.loss_temp  # the cross-entropy kernel: one bf16 gradient, not three fp32 tensors
    monkeypatch.setenv("PIPETRAIN_KERNELS", "torch")  # the torch references on CUDA keep what the CPU keeps
    assert total(LLAMA_1B, BF16).activations == cpu.activations
    monkeypatch.delenv("PIPETRAIN_KERNELS")
    assert total(LLAMA_1B, FP8).activations < cuda.activations  # linear inputs in float8
    unfused, fused = total(LLAMA_1B5, {**BF16, "fused_loss": False}), total(LLAMA_1B5, {**BF16, "fused_loss": True})
    assert fused.total < unfused.total and fused.loss_temp < unfused.loss_temp
    # "auto" is the fused loss on CUDA at this vocabulary (config.fused_loss_on), the unfused one on the CPU
    assert total(LLAMA_1B5, BF16).as_dict() == fused.as_dict()
    assert total(LLAMA_1B5, BF16, staged=True).loss_temp > fused.loss_temp


def test_preflight_checks_the_card_pipetrain_device_names_with_that_cards_model(monkeypatch):
    """A dry run on this CPU machine for an 80 GB H100: the llama 1.0B in fp8 at 16 sequences of 2048 (the H200
    measured 51.8 GiB) fits; the CPU's model (the torch references, fp8 counted as fp32) refused it at 125 GB.
    A batch four times as large is still refused."""
    monkeypatch.setenv("PIPETRAIN_DEVICE", "h100-sxm-80gb")
    monkeypatch.delenv("PIPETRAIN_KERNELS", raising=False)
    check_model_fits(recipe_of(LLAMA_1B, FP8), 1)
    with pytest.raises(ConfigError, match=r"^train.global_batch=64: pp rank 0 needs about .* GB at its peak"):
        check_model_fits(recipe_of(LLAMA_1B, FP8, sequences=64), 1)


SMALL = ModelConfig(family="llama", d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=64,
                    ffn_hidden=512)


def _saved_block_bytes_per_token(precision: str, recompute: str, B: int = 2, T: int = 48) -> float:
    """Bytes per token and block of the activations SMALL's blocks keep for backward under bf16 autocast on the CPU
    (fp8 through its emulation): unique storages whose first dim is tokens or sequences (weights' copies left out)."""
    model = materialize(build(SMALL), SMALL, seed=0, device="cpu")
    apply_grad_accumulation_fusion(model, None)
    apply_recompute(model, ParallelConfig(recompute=recompute))
    if precision == "fp8":
        apply_fp8(model, ParallelDims(), SMALL, emulate=True)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and t.dim() and t.shape[0] in (B * T, B):
            kept[storage.data_ptr()] = storage.nbytes()
        return t
    h = model.embed(torch.randint(0, SMALL.vocab_size, (B, T))).detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        for layer in model.layers.values():
            h = layer(h)
    return sum(kept.values()) / (B * T * SMALL.n_layers)


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_fp8_saves_what_the_model_says_against_bf16(recompute):
    """fp8's linears keep float8 inputs: one byte where bf16 keeps two, but the attention output, which the
    attention kernel keeps in bf16 for itself without recompute, costs a float8 copy on top (the model once
    counted a saving there, 2 GiB too little on the llama 1.0B)."""
    saving = _saved_block_bytes_per_token("bf16", recompute) - _saved_block_bytes_per_token("fp8", recompute)
    assert saving == fp8_linear_input_savings(SMALL, 1, attention_keeps_output=recompute == "none", compiled=False)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_full_recompute_keeps_the_fp32_block_input_under_autocast(precision):
    """The residual stream stays fp32 under autocast, so a fully recomputed block keeps 4 bytes per channel; the
    model once halved it as it halves the block's bf16 tensors."""
    assert _saved_block_bytes_per_token(precision, "full") == 4 * SMALL.d_model
    recipe = Recipe(model=SMALL, parallel=ParallelConfig(recompute="full"),
                    train=TrainConfig(global_batch=2, seq_len=48, precision=precision))
    fp32 = Recipe(model=SMALL, parallel=ParallelConfig(recompute="full"), train=TrainConfig(global_batch=2, seq_len=48))
    # the same block inputs as fp32; beside them only the head's bf16 weight copy (the next test)
    head_copy = 2 * SMALL.vocab_size * SMALL.d_model
    assert activation_bytes(recipe, 1, 0, in_flight=1) == activation_bytes(fp32, 1, 0, in_flight=1) + head_copy
    assert saved_bytes_per_token(SMALL, 1, 48, False, "full")[0] == 4 * SMALL.d_model


def test_the_triton_path_is_counted_only_where_the_kernels_run(monkeypatch):
    from pipetrain.plan import precision
    monkeypatch.delenv("PIPETRAIN_KERNELS", raising=False)
    monkeypatch.setattr(precision, "HAS_TRITON", True)
    assert precision.triton_path("cuda") and not precision.triton_path("cpu")
    monkeypatch.setattr(precision, "HAS_TRITON", False)  # CUDA without triton runs the torch references
    assert not precision.triton_path("cuda")
    monkeypatch.setenv("PIPETRAIN_KERNELS", "triton")
    assert precision.triton_path("cuda")
    monkeypatch.setenv("PIPETRAIN_KERNELS", "torch")
    monkeypatch.setattr(precision, "HAS_TRITON", True)
    assert not precision.triton_path("cuda")
    # rank_memory counts a CPU run unless told the device: a caller that forgets cannot get the smaller GPU counts
    recipe = recipe_of(LLAMA_1B, BF16)
    assert rank_memory(recipe, 1)[0].as_dict() == rank_memory(recipe, 1, device_type="cpu")[0].as_dict()


def test_full_recompute_in_bf16_counts_the_heads_weight_copy():
    """The head is never recomputed: under bf16 autocast its bf16 weight copy stays saved beside the fp32 block
    inputs; at vocab 4096 the model without it was 0.72x the saved tensors."""
    import dataclasses
    from pipetrain.parallel.pipeline.stage import build_stage
    from tests.harness import saved_activation_bytes
    seq, batch = 32, 8
    cfg = dataclasses.replace(SMALL, vocab_size=4096, max_seq_len=seq)
    recipe = Recipe(model=cfg, parallel=ParallelConfig(microbatches=2, recompute="full"),
                    train=TrainConfig(global_batch=batch, seq_len=seq, precision="bf16"))
    model, _, _ = build_stage(build(cfg, device="meta"), ParallelDims(), recipe.parallel, seq)
    materialize(model, cfg, 0, "cpu")
    apply_recompute(model, recipe.parallel)
    tokens = torch.randint(0, cfg.vocab_size, (batch // 2, seq + 1), generator=torch.Generator().manual_seed(0))
    measured = saved_activation_bytes(model, tokens[:, :-1], tokens[:, 1:], torch.autocast("cpu", dtype=torch.bfloat16))
    planned = activation_bytes(recipe, 1, 0, in_flight=1)
    assert abs(planned - measured) <= 0.15 * measured, (planned, measured)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_fp8_weight_cache_is_counted_once_a_run_not_per_microbatch(family):
    """With several microbatches a step fp8's linears read weights quantised once a run into holders
    (fp8.Fp8WeightCache): the model counts the holders' bytes once, as built here (emulation: one float8 copy),
    and no per-microbatch copy of those weights (it counted 2 bytes an element per microbatch in flight)."""
    from pipetrain.parallel.pipeline.weight_grads import apply_grad_accumulation_fusion
    from pipetrain.parallel.tensor.fp8 import Fp8WeightCache
    from pipetrain.plan.precision import fp8_linear_elements
    cfg = ModelConfig(family=family, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2 if family == "llama" else None,
                      vocab_size=256, max_seq_len=64, ffn_hidden=512)
    model = materialize(build(cfg), cfg, seed=0, device="cpu")
    apply_grad_accumulation_fusion(model, None)
    apply_fp8(model, ParallelDims(), cfg, emulate=True)
    held = sum(h.data.untyped_storage().nbytes() for _, h in Fp8WeightCache(model).entries)

    def recipe(microbatches):  # two sequences a microbatch either way
        return Recipe(model=cfg, parallel=ParallelConfig(microbatches=microbatches),
                      train=TrainConfig(global_batch=2 * microbatches, seq_len=64, precision="fp8", fp8_emulate=True))
    cached, uncached = rank_memory(recipe(2), 1)[0], rank_memory(recipe(1), 1)[0]
    assert cached.weight_cache == held > 0 and uncached.weight_cache == 0
    assert uncached.activations - cached.activations == 2 * fp8_linear_elements(cfg, 1) * cfg.n_layers
    # on the hardware the holders keep the column-major copy too
    assert rank_memory(Recipe(model=cfg, parallel=ParallelConfig(microbatches=2),
                              train=TrainConfig(global_batch=4, seq_len=64, precision="fp8")), 1,
                       device_type="cuda")[0].weight_cache == 2 * held
