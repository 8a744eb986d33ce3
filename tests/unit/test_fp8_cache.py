"""fp8 weights quantised once per executor run (fp8.Fp8WeightCache): under several microbatches a step each fp8
linear quantised its weight again at every call. The weights do not change within a run, so training and
evaluation give the losses of the per-call quantisation bit for bit, with one quantisation of each weight a run;
a forward outside a run (a sample) sees the weights as they are then."""
import contextlib
import dataclasses
import os

import pytest
import torch

from pipetrain import build
from pipetrain.generate.decode import KVCache, forward_cached, generate_tokens
from pipetrain.kernels import fp8_quant
from pipetrain.parallel.tensor import fp8
from tests.unit.common import GPT2, LLAMA, build_trainer

STEPS = 3


def _trainer(out, cached: bool, monkeypatch, cfg=LLAMA, **keys):
    os.makedirs(out)
    with monkeypatch.context() as m:
        if not cached:
            m.setattr(build, "fp8_weights_once_a_run", lambda recipe: False)
        return build_trainer(cfg, str(out), precision="fp8", steps=STEPS, learnable=True, val_fraction=0.25,
                             **keys)


def _curve(trainer) -> list[tuple[float, float]]:
    """Each step's training loss, then the evaluation loss after it (bf16 autocast on the CPU: fp8's run)."""
    out = []
    for _ in range(STEPS):
        out.append((trainer.train_step()["loss"], trainer.evaluate()["eval_loss"]))
    return out


def _count_weight_quantisations(monkeypatch, trainer) -> list:
    """Record every float8_e4m3fn quantisation of a tensor shaped like one of the model's fp8 weights."""
    shapes = {tuple(m.weight.shape) for m in trainer.model.modules() if getattr(m, "fp8", None) is not None}
    calls, real = [], fp8.quantize

    def counting(t, scale, dtype):
        if dtype == fp8.FORWARD_DTYPE and tuple(t.shape) in shapes and t.dtype == torch.float32:
            calls.append(tuple(t.shape))
        return real(t, scale, dtype)
    monkeypatch.setattr(fp8, "quantize", counting)  # the cache's fill
    monkeypatch.setattr(fp8_quant, "quantize", counting)  # a linear's own (quantize_tensorwise's reference)
    return calls


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_weights_quantised_once_a_run_train_and_evaluate_as_each_call_quantising_them(tmp_path, monkeypatch, cfg):
    cached = _trainer(tmp_path / "cached", True, monkeypatch, cfg, microbatches=4)
    plain = _trainer(tmp_path / "plain", False, monkeypatch, cfg, microbatches=4)
    linears = [m for m in cached.model.modules() if getattr(m, "fp8", None) is not None]
    assert linears and all(m.fp8.gathered is not None for m in linears)
    assert all(m.fp8.gathered is None for m in plain.model.modules() if getattr(m, "fp8", None) is not None)

    calls = _count_weight_quantisations(monkeypatch, cached)
    got = _curve(cached)
    # one quantisation of each weight per run: a training step and each of the 2 evaluation batches
    assert len(calls) == STEPS * 3 * len(linears), f"{len(calls)} weight quantisations for {len(linears)} linears"
    calls.clear()
    want = _curve(plain)
    # once a call: each of the step's 4 microbatches, and the 4 of each evaluation batch
    assert len(calls) == STEPS * (4 + 2 * 4) * len(linears)
    assert got == want, f"once a run {got} against once a call {want}"
    assert got[-1][0] < got[0][0]  # it trains


def test_one_microbatch_and_zero3_keep_quantising_in_the_call(tmp_path, monkeypatch):
    """One microbatch: one quantisation a step either way, inside the compiled block's graph. ZeRO-3 gathers
    its fp8 weights quantised already (its own holders)."""
    one = _trainer(tmp_path / "one", True, monkeypatch)
    assert all(m.fp8.gathered is None for m in one.model.modules() if getattr(m, "fp8", None) is not None)
    assert one.executor.around_run is contextlib.nullcontext
    def recipe(**parallel):
        return dataclasses.replace(one.recipe, parallel=dataclasses.replace(one.recipe.parallel, **parallel))
    assert not build.fp8_weights_once_a_run(recipe(zero=3, microbatches=4))
    assert build.fp8_weights_once_a_run(recipe(zero=2, microbatches=4))


def test_a_forward_outside_a_run_quantises_the_weights_after_the_last_update(tmp_path, monkeypatch):
    """The end-of-run sample calls the blocks' modules itself (generate.decode.forward_cached), after the last
    update and with no evaluation run after it (no validation windows here): the holders are current only
    inside a run, so it gets what quantising each call gives, bit for bit; so does a call of the model."""
    os.makedirs(tmp_path / "cached")
    os.makedirs(tmp_path / "plain")
    cached = build_trainer(LLAMA, str(tmp_path / "cached"), precision="fp8", steps=STEPS, microbatches=2)
    with monkeypatch.context() as m:
        m.setattr(build, "fp8_weights_once_a_run", lambda recipe: False)
        plain = build_trainer(LLAMA, str(tmp_path / "plain"), precision="fp8", steps=STEPS, microbatches=2)
    assert cached.evaluate() == {}  # no validation windows: nothing runs between the last step and the sample
    ids = torch.arange(16).reshape(1, 16) % LLAMA.vocab_size
    for _ in range(2):
        cached.train_step()
        plain.train_step()
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            for call in (lambda model: forward_cached(model, ids, KVCache()), lambda model: model(ids)):
                torch.testing.assert_close(call(cached.model), call(plain.model), rtol=0.0, atol=0.0)
    assert generate_tokens(cached.model, [1, 2], 8, seed=0) == generate_tokens(plain.model, [1, 2], 8, seed=0)


def test_compiled_blocks_read_the_holders_and_equal_compiled_blocks_quantising_in_each_call(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPETRAIN_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    cached = _trainer(tmp_path / "cached", True, monkeypatch, microbatches=2, compile=True)
    got = _curve(cached)
    # the blocks share a graph (training, and no_grad evaluation); the quantisation one per weight shape (the
    # llama's wq / wo, wk / wv, gate / up, down): each a graph of its own that no call retraces
    shapes = {tuple(m.weight.shape) for m in cached.model.modules() if getattr(m, "fp8", None) is not None}
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 2 + len(shapes)
    torch._dynamo.reset()
    plain = _trainer(tmp_path / "plain", False, monkeypatch, microbatches=2, compile=True)
    assert got == _curve(plain)
    torch._dynamo.reset()


def test_the_hardware_path_reads_the_column_major_copy_and_equals_each_call_quantising(tmp_path, monkeypatch):
    """torch._scaled_mm (forced on the CPU, where it runs too) takes dx = dy W's weight column-major: the holders
    keep that copy, where each backward transposed its own; the GEMMs get the same operands, so the same results."""
    monkeypatch.setattr(fp8, "uses_hardware", lambda device, emulate: True)
    cached = _trainer(tmp_path / "cached", True, monkeypatch, microbatches=2)
    holders = [m.fp8.gathered for m in cached.model.modules() if getattr(m, "fp8", None) is not None]
    assert holders and all(h.columns is not None and h.columns.t().is_contiguous() for h in holders)
    plain = _trainer(tmp_path / "plain", False, monkeypatch, microbatches=2)
    saved = []

    def pack(t):
        saved.append(any(t is h.columns for h in holders))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        first = cached.train_step()["loss"]
    assert sum(saved) == 2 * len(holders)  # each linear's backward reads the copy, in each of 2 microbatches
    assert first == plain.train_step()["loss"]
    assert _curve(cached) == _curve(plain)
    assert all(torch.equal(h.columns, h.data) for h in holders)
