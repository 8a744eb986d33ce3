"""Under train.precision=bf16 every matmul of a training step takes bf16 operands, whatever the model family and
feature: a GEMM left in fp32 costs ten times its bf16 time on a GPU's tensor cores and shows in no loss. (The
fused loss ran its three head GEMMs in fp32 outside the chunks' autocast: 0.88x the unfused run's tokens/s on
an H100, docs/benchmarks.md.)"""
from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.unit.common import GPT2, LLAMA, build_trainer

# the aten ops a training step's matmuls and attention reach (CPU dispatch; CUDA's have other attention names) ->
# how many of their leading tensor arguments are operands (None: all): the attention backward's sixth is the
# forward's logsumexp, fp32 by design
MATMULS = {"mm": None, "addmm": None, "bmm": None, "baddbmm": None, "_grouped_mm": None,
           "_scaled_dot_product_flash_attention_for_cpu": None,
           "_scaled_dot_product_flash_attention_for_cpu_backward": 5}  # grad_out, q, k, v, out


class _MatmulDtypes(TorchDispatchMode):
    """Counts (op, dtypes of its matrix operands) of every matmul-like op."""

    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in MATMULS:
            operands = [a for a in args if isinstance(a, torch.Tensor)][:MATMULS[name]]
            self.seen[(name, tuple(a.dtype for a in operands if a.dim() >= 2))] += 1
        return func(*args, **(kwargs or {}))


CASES = {
    "llama": (LLAMA, {}),
    "gpt2-tied": (GPT2, {}),
    "fused-loss": (LLAMA, {"fused_loss": True}),
    "gpt2-fused-loss": (GPT2, {"fused_loss": True}),
    "lora": (dataclasses.replace(LLAMA, lora_rank=4, lora_alpha=8.0), {}),
    "moe-shared-expert": (dataclasses.replace(LLAMA, family="mixtral", num_experts=4, num_experts_per_tok=2,
                                              shared_expert_intermediate_size=32), {}),
    "gradient-accumulation-fusion": (LLAMA, {"fusion_min_numel": 0, "microbatches": 2}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_matmul_of_a_bf16_training_step_takes_bf16_operands(tmp_path, case):
    cfg, extra = CASES[case]
    trainer = build_trainer(cfg, str(tmp_path), precision="bf16", steps=2, **extra)
    trainer.train_step()  # the first step builds the optimizer state; the second is the steady one
    probe = _MatmulDtypes()
    with probe:
        trainer.train_step()
    ops = {name for name, _ in probe.seen}
    assert "mm" in ops and "_scaled_dot_product_flash_attention_for_cpu_backward" in ops, probe.seen
    wrong = {key: n for key, n in probe.seen.items() if any(dtype != torch.bfloat16 for dtype in key[1])}
    assert not wrong, f"matmuls outside bf16 under train.precision=bf16: {wrong}"


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_the_linears_after_a_norm_take_its_bf16_output_as_it_is(tmp_path, cfg):
    """The norms write autocast's bf16 (models/decoder.py, norm_output_dtype): q, k and v (and gate and up) get
    one bf16 tensor, which autocast neither copies nor saves again per linear; an fp32 norm output made each
    of them cast it."""
    trainer = build_trainer(cfg, str(tmp_path), precision="bf16", steps=1)
    inputs = {}
    hooks = [module.register_forward_pre_hook(lambda m, args, name=name: inputs.setdefault(name, args[0]))
             for name, module in trainer.model.named_modules() if isinstance(module, torch.nn.Linear)]
    trainer.train_step()
    for hook in hooks:
        hook.remove()
    wrong = {name: x.dtype for name, x in inputs.items() if x.dtype != torch.bfloat16}
    assert not wrong, f"linears given an activation outside bf16 under train.precision=bf16: {wrong}"
    block = "layers.0."
    q, k, v = (inputs[f"{block}attn.{name}"] for name in ("wq", "wk", "wv"))
    assert q is k is v, "q, k and v got different tensors: the attention norm's output was copied per linear"
    assert inputs["head"].dtype == torch.bfloat16


def test_a_moe_sums_the_weighted_expert_outputs_of_a_token_in_fp32_under_bf16(tmp_path):
    """The norm hands the MoE a bf16 x; the routing weights and the sum of a token's k weighted expert
    outputs stay fp32, as when the norm returned fp32 (precision: a bf16 sum of k terms rounds each add)."""
    from pipetrain.models.moe import MoE
    trainer = build_trainer(CASES["moe-shared-expert"][0], str(tmp_path), precision="bf16", steps=1)
    combined = []
    hooks = [module.register_forward_hook(lambda m, args, out: combined.append((args[0].dtype, out.dtype)))
             for module in trainer.model.modules() if isinstance(module, MoE)]
    trainer.train_step()
    for hook in hooks:
        hook.remove()
    assert combined and set(combined) == {(torch.bfloat16, torch.float32)}, combined
