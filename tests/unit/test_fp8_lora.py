"""LoRA under train.precision=fp8: the frozen base projections run as fp8 linears, the adapters in the autocast
dtype beside them, and each adapted projection's output is its fp8 base's plus (alpha / r) B A x, on both of the
paths a projection takes (its own forward, and the linears of one input, which quantise x once for wq, wk, wv
and gate, up). Training moves the adapters only, bit for bit leaves the base where it was, and follows bf16
LoRA within fp8's tolerance. (tp=2 against tp=1: tests/dist/test_fp8.py.)"""
import dataclasses

import pytest
import torch

from pipetrain.parallel.tensor.fp8 import Fp8Linear
from tests.unit.common import LLAMA, build_trainer

LORA = dataclasses.replace(LLAMA, lora_rank=4, lora_alpha=8.0, lora_targets=["wq", "wk", "wv", "wo", "gate", "up",
                                                                           "down"])
STEPS = 4


def _trainer(out, precision, **kw):
    out.mkdir()
    return build_trainer(LORA, str(out), steps=STEPS, learnable=True, precision=precision, **kw)


def test_each_adapted_projection_is_its_fp8_base_plus_its_adapter_on_both_paths(tmp_path):
    trainer = _trainer(tmp_path / "run", "fp8")
    block = next(iter(trainer.model.layers.values()))
    adapted = {n: m for n, m in block.named_modules() if hasattr(m, "lora_delta")}
    assert set(adapted) == {"attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.gate", "mlp.up", "mlp.down"}
    assert all(isinstance(m.fp8, Fp8Linear) for m in adapted.values())
    assert block.attn.shared_input is not None and block.mlp.shared_input is not None  # x quantised once
    for m in adapted.values():  # nonzero adapters (B starts at zero), so a dropped delta shows
        torch.nn.init.normal_(m.lora_B, std=0.5)
    torch.manual_seed(0)
    x = torch.randn(2, 8, LORA.d_model)
    got = dict(zip(("attn.wq", "attn.wk", "attn.wv"),  # the shared path: the linears of one input together
                   block.attn.shared_input(x, (block.attn.wq, block.attn.wk, block.attn.wv))))
    got.update(zip(("mlp.gate", "mlp.up"), block.mlp.shared_input(x, (block.mlp.gate, block.mlp.up))))
    got["attn.wo"] = block.attn.wo(x)  # a projection's own forward
    for name, y in got.items():
        m = adapted[name]
        want = Fp8Linear()(x, m.weight, m.bias) + m.lora_delta(x)
        torch.testing.assert_close(y, want, rtol=0, atol=0, msg=name)
        assert not torch.equal(want, Fp8Linear()(x, m.weight, m.bias))  # the adapter is in it


def test_fp8_lora_trains_the_adapters_only_and_follows_bf16_lora(tmp_path):
    def run(precision):
        trainer = _trainer(tmp_path / precision, precision)
        base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
        losses = [trainer.train_step()["loss"] for _ in range(STEPS)]
        frozen = all(torch.equal(p, base[n]) for n, p in trainer.model.named_parameters() if n in base)
        moved = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
        return losses, frozen, moved
    fp8, frozen, moved = run("fp8")
    bf16, _, _ = run("bf16")
    assert frozen and moved and all("lora_" in n for n in moved), moved
    assert fp8 != bf16 and fp8 == pytest.approx(bf16, rel=2e-2), (fp8, bf16)
    assert fp8[-1] < fp8[0]
