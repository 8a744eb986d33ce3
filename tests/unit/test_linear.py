"""Weight gradients of pipetrain.parallel.pipeline.weight_grads: the fused / deferred linear and embedding.

Deferred (split backward): the same numbers as plain autograd for one microbatch, bit for bit; hooks
fire once per W, never in the input pass. Fused (gradient accumulation fusion): added into .grad in
place; equal to plain autograd to fp32 round-off (bit for bit under bf16 autocast, where the add is
the same fp32 add), hooks fire once per backward after the add, a tied weight's too."""
import pytest
import torch
import torch.nn.functional as F

from pipetrain.parallel.pipeline.weight_grads import (WeightGradLinear, apply_grad_accumulation_fusion, apply_weight_grads,
                                                      deferring, linear)


def _grads(x, weight, bias, dy, mode, autocast=False):
    for t in (x, weight, bias):
        if t is not None:
            t.grad = None
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    work = []
    with ctx:
        y = F.linear(x, weight, bias) if mode == "autograd" else linear(x, weight, bias, work=work)
    y.backward(dy.to(y.dtype))
    if mode == "deferred":
        assert weight.grad is None and (bias is None or bias.grad is None) and len(work) == 1
        apply_weight_grads(work)
        assert work == []
    return y.detach(), [t.grad for t in (x, weight, bias) if t is not None]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_deferred_linear_equals_plain_autograd_bitwise(bias, autocast):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=gen, requires_grad=True)
    weight = torch.randn(24, 16, generator=gen, requires_grad=True)
    b = torch.randn(24, generator=gen, requires_grad=True) if bias else None
    dy = torch.randn(3, 5, 24, generator=gen)
    ref_y, ref = _grads(x, weight, b, dy, "autograd", autocast)
    y, got = _grads(x, weight, b, dy, "deferred", autocast)
    assert torch.equal(y, ref_y)
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype and torch.equal(g, r)


def test_deferred_grads_accumulate_and_fire_post_accumulate_hooks():
    torch.manual_seed(0)
    layer = WeightGradLinear(8, 4)
    fired = []
    layer.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    xs = [torch.randn(2, 8, requires_grad=True) for _ in range(2)]
    works = [[], []]
    for x, work in zip(xs, works):  # two microbatches: both input backward passes first, weight gradients later
        with deferring([layer], work):
            y = layer(x)
        y.sum().backward()
    assert layer.weight.grad is None and fired == []
    for work in works:
        apply_weight_grads(work)
    assert len(fired) == 2
    ref = torch.nn.Linear(8, 4)
    ref.load_state_dict(layer.state_dict())
    for x in xs:
        ref(x).sum().backward()
    # The second W adds inside the GEMM (addmm_), autograd after it: the same sum, rounded at a point
    # that depends on the BLAS kernel (bitwise on some CPUs, not on others); the bias add is autograd's.
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad, rtol=1e-6, atol=1e-7)
    assert torch.equal(fired[0], xs[0].grad.new_ones(2, 4).t().mm(xs[0].detach()))  # the first W alone, exact
    assert torch.equal(layer.bias.grad, ref.bias.grad)


def test_a_weight_that_is_not_a_leaf_or_an_input_without_grad_gets_its_gradient_at_once():
    weight = torch.randn(6, 4, requires_grad=True)
    work = []
    y = linear(torch.randn(2, 4, requires_grad=True), weight[2:4], work=work)  # a slice, as ReplicatedKVLinear uses
    z = linear(torch.randn(2, 4), weight, work=work)  # no input gradient: deferring would cut the graph
    (y.sum() + z.sum()).backward()
    assert work == [] and weight.grad is not None and weight.grad[:2].abs().sum() > 0


def test_nested_deferral_restores_the_outer_list_and_nothing_is_recorded_outside():
    outer, inner, layer = [], [], WeightGradLinear(4, 4)
    x = torch.randn(1, 4, requires_grad=True)
    with deferring([layer], outer):
        with deferring([layer], inner):
            a = layer(x)
        b = layer(x)
    c = layer(x)  # outside: plain F.linear
    (a.sum() + b.sum() + c.sum()).backward()
    assert len(inner) == 1 and len(outer) == 1
    ref = layer.weight.grad.clone()  # c's weight gradient only
    apply_weight_grads(inner)
    apply_weight_grads(outer)
    torch.testing.assert_close(layer.weight.grad, 3 * ref)


# ---- gradient accumulation fusion -------------------------------------------------------------------
class _Tiny(torch.nn.Module):
    """embedding -> linear -> head, optionally tied, plain modules under GRAD_PLAN's names: every fused
    path in one graph once apply_grad_accumulation_fusion swapped them."""

    def __init__(self, tied: bool):
        super().__init__()
        self.embed, self.mlp, self.head = torch.nn.Embedding(40, 16), torch.nn.Module(), torch.nn.Linear(16, 40, bias=False)
        self.mlp.up = torch.nn.Linear(16, 16)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mlp.up(self.embed(ids))))


def _accumulate_microbatches(model, batches, fuse: bool, autocast: bool = False):
    """Gradients after one backward per microbatch, and how often each parameter's hook fired, with
    what .grad it saw."""
    model.zero_grad(set_to_none=True)
    seen = {n: [] for n, _ in model.named_parameters()}
    handles = [p.register_post_accumulate_grad_hook(lambda p, n=n: seen[n].append(p.grad.clone()))
               for n, p in model.named_parameters()]
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    apply_grad_accumulation_fusion(model, 0 if fuse else None)  # 0: fuse these small weights too
    for ids in batches:
        with ctx:
            out = model(ids)
        out.float().square().mean().backward()
    for h in handles:
        h.remove()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, seen


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_fused_accumulation_equals_plain_autograd_and_fires_each_hook_once_per_backward(tied, autocast):
    torch.manual_seed(0)
    model = _Tiny(tied)
    batches = [torch.randint(0, 40, (3, 7)) for _ in range(4)]  # repeated ids within and across batches
    ref, ref_seen = _accumulate_microbatches(model, batches, fuse=False, autocast=autocast)
    got, seen = _accumulate_microbatches(model, batches, fuse=True, autocast=autocast)
    assert got.keys() == ref.keys()
    for n in ref:
        assert len(seen[n]) == len(ref_seen[n]) == len(batches), n  # tied: once, as autograd fires it
        assert torch.equal(seen[n][-1], got[n]), n  # the hook runs after the in-place add
        if autocast and "embed" not in n:  # bf16 GEMM, then the same fp32 add as autograd's
            assert torch.equal(got[n], ref[n]), n
        else:
            torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-7)


def test_fused_linear_adds_in_place_and_gives_the_weight_a_gradient_when_the_input_needs_none():
    layer = WeightGradLinear(8, 4)
    layer.fuse = True
    x = torch.randn(5, 8)  # no gradient: the layer is the first to need one
    layer(x).sum().backward()
    first = layer.weight.grad
    layer(x).sum().backward()
    assert layer.weight.grad is first  # the same tensor, added into
    torch.testing.assert_close(first, 2 * torch.ones(4, 1) * x.sum(0))
    torch.testing.assert_close(layer.bias.grad, torch.full((4,), 10.0))


def test_fusion_is_off_by_default_only_for_weights_above_the_threshold_and_bound_at_forward_time():
    model = _Tiny(tied=False)  # head 40 x 16 = 640 elements, mlp.up 16 x 16 = 256
    ids = torch.randint(0, 40, (2, 3))
    assert type(model.head(model.embed(ids)).grad_fn).__name__ != "_LinearFnBackward"  # plain modules
    apply_grad_accumulation_fusion(model, 640)
    assert model.head.fuse and not model.mlp.up.fuse and model.embed.fuse  # embeddings at any size
    h = model.embed(ids)
    assert type(h.grad_fn).__name__ == "_EmbeddingFnBackward"
    fused, unfused = model.head(h), model.mlp.up(h)
    assert type(fused.grad_fn).__name__ == "_LinearFnBackward"
    assert type(unfused.grad_fn).__name__ != "_LinearFnBackward"
    model.head.fuse = False  # a forward already run keeps its mode
    fused.sum().backward()
    assert model.head.weight.grad is not None and type(model.head(h).grad_fn).__name__ != "_LinearFnBackward"
    apply_grad_accumulation_fusion(model, None)  # again: nothing fused
    assert not any(getattr(m, "fuse", False) for m in model.modules())
    with torch.no_grad():
        model.head.fuse = True
        assert model.head(h).grad_fn is None
