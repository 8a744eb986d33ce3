"""The tiny decoder on the Triton kernels (interpreted) gives the reference path's loss and gradients."""
import pytest
import torch

from pipetrain.config import ModelConfig
from pipetrain.kernels import cross_entropy, linear_cross_entropy
from pipetrain.models import build, materialize
from tests.kernels.common import fresh_seed

# Two layers of fp32 kernels whose reductions run in a different order than torch's: round-off
# compounds through the layers and the backward, so a little looser than one kernel's FP32.
MODEL_FP32 = dict(rtol=1e-4, atol=1e-5)


def _tiny_model():
    cfg = ModelConfig(family="llama", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=32)
    return materialize(build(cfg), cfg, seed=0, device="cpu")


def _loss_and_grads(monkeypatch, path, tokens, targets, fused_head):
    monkeypatch.setenv("PIPETRAIN_KERNELS", path)
    model = _tiny_model()
    if fused_head:
        head, model.head = model.head, None  # forward skips a missing head and returns (B, T, D)
        hidden = model(tokens)
        loss = linear_cross_entropy(hidden.flatten(0, 1), head.weight, targets.flatten())
        model.head = head
    else:
        loss = cross_entropy(model(tokens), targets)
    nodes = _graph_node_names(loss)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, nodes


def _graph_node_names(loss):
    seen, stack, names = set(), [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(node.name())
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return names


@pytest.mark.triton
@pytest.mark.parametrize("fused_head", [False, True], ids=["head+cross_entropy", "linear_cross_entropy"])
def test_tiny_model_on_triton_kernels_matches_reference_loss_and_grads(monkeypatch, fused_head):
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    # T=16 < max_seq_len keeps the interpreted run short
    tokens = torch.randint(0, 128, (2, 16), generator=g)  # (B, T)
    targets = torch.randint(0, 128, (2, 16), generator=g)
    targets[0, :5] = -100
    want_loss, want, ref_nodes = _loss_and_grads(monkeypatch, "torch", tokens, targets, fused_head)
    got_loss, got, nodes = _loss_and_grads(monkeypatch, "triton", tokens, targets, fused_head)
    fns = {"RMSNormFn", "RoPEFn", "SwiGLUFn", "LinearCrossEntropyFn" if fused_head else "CrossEntropyFn"}
    taken = {f for f in fns if any(n.startswith(f) for n in nodes)}
    assert taken == fns, f"the Triton path ran {sorted(taken)} of {sorted(fns)}"
    assert not any(n.startswith(f) for f in fns - {"LinearCrossEntropyFn"} for n in ref_nodes), sorted(ref_nodes)
    torch.testing.assert_close(got_loss, want_loss, **MODEL_FP32, msg=lambda m: f"seed={seed} loss: {m}")
    assert got.keys() == want.keys()
    for name in want:
        assert got[name] is not None, f"{name}: no gradient on the Triton path"
        torch.testing.assert_close(got[name], want[name], **MODEL_FP32, msg=lambda m: f"seed={seed} {name}: {m}")


# bf16 end to end: the kernels round once where torch's bf16 ops may round twice (rms_norm, swiglu and
# cross_entropy are within an ulp per element, rope is exact), and those ulps compound through two
# layers and the backward, so compare gradients by relative norm rather than elementwise (the seeds
# tried gave bit-identical gradients; the bound leaves room for rare ulp flips to propagate).
MODEL_BF16_REL = 1e-2


@pytest.mark.slow
@pytest.mark.triton
def test_tiny_bf16_model_on_triton_kernels_matches_reference_within_bf16_noise(monkeypatch):
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 128, (2, 32), generator=g)
    targets = torch.randint(0, 128, (2, 32), generator=g)
    results = {}
    for path in ("torch", "triton"):
        monkeypatch.setenv("PIPETRAIN_KERNELS", path)
        model = _tiny_model().to(torch.bfloat16)
        loss = cross_entropy(model(tokens), targets)
        loss.backward()
        results[path] = loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}
    (want_loss, want), (got_loss, got) = results["torch"], results["triton"]
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-2, atol=0, msg=lambda m: f"seed={seed} loss: {m}")
    for name in want:
        rel = ((got[name] - want[name]).norm() / want[name].norm()).item()
        assert rel < MODEL_BF16_REL, f"seed={seed} {name}: relative gradient difference {rel:.3g}"


def _saved_block_bytes(model, tokens) -> int:
    """Bytes of the unique non-parameter storages the model's blocks save for backward in one forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    h = model.embed(tokens).detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for layer in model.layers.values():
            h = layer(h)
    return sum(storages.values())


@pytest.mark.triton
def test_planned_block_bytes_follow_what_the_triton_path_saves(monkeypatch):
    """plan.memory counts a block's saved tensors per path (kernels=True: the Triton path, which a CUDA run takes):
    the SwiGLU kernel keeps gate and up where the torch reference keeps silu(gate) too, the RMSNorm kernel x and
    rstd where the reference keeps x * rstd too. The measured difference between the paths is the planned one,
    and each path's bytes are within the planner's 15%."""
    from pipetrain.plan.memory import saved_bytes_per_token
    cfg = ModelConfig(family="llama", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=32,
                      ffn_hidden=256)
    B, T = 2, 16
    tokens = torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(0))
    measured, planned = {}, {}
    for path, kernels in (("torch", False), ("triton", True)):
        monkeypatch.setenv("PIPETRAIN_KERNELS", path)
        measured[path] = _saved_block_bytes(materialize(build(cfg), cfg, seed=0, device="cpu"), tokens)
        # RoPE's cos/sin tables (T x K, fp32) each block keeps beside the per-token bytes (plan.memory)
        planned[path] = cfg.n_layers * (B * T * saved_bytes_per_token(cfg, 1, T, False, "none", kernels=kernels)[0]
                                        + 4 * 2 * T * cfg.head_dim)
        assert abs(planned[path] - measured[path]) <= 0.15 * measured[path], (path, planned[path], measured[path])
    assert measured["torch"] - measured["triton"] == planned["torch"] - planned["triton"] == \
        cfg.n_layers * B * T * (cfg.ffn + 2 * cfg.d_model) * 4  # (tokens, F) and two (tokens, D) fp32 a block
