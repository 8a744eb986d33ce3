"""Deferred weight gradients (pipetrain.models.linear): the same numbers as plain autograd, bit for bit;
accumulated through autograd so gradient hooks fire once per microbatch, never in the input pass."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from pipetrain.models.linear import Linear, apply_weight_grads, defer_weight_grads, linear


def _grads(x, weight, bias, dy, mode, autocast=False):
    for t in (x, weight, bias):
        if t is not None:
            t.grad = None
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    work = []
    with ctx, defer_weight_grads(work) if mode == "deferred" else contextlib.nullcontext():
        y = F.linear(x, weight, bias) if mode == "autograd" else linear(x, weight, bias)
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
    layer = Linear(8, 4)
    fired = []
    layer.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    xs = [torch.randn(2, 8, requires_grad=True) for _ in range(2)]
    works = [[], []]
    for x, work in zip(xs, works):  # two microbatches: both input backward passes first, weight gradients later
        with defer_weight_grads(work):
            y = layer(x)
        y.sum().backward()
    assert layer.weight.grad is None and fired == []
    for work in works:
        apply_weight_grads(work)
    assert len(fired) == 2
    ref = Linear(8, 4)
    ref.load_state_dict(layer.state_dict())
    for x in xs:
        ref(x).sum().backward()
    assert torch.equal(layer.weight.grad, ref.weight.grad) and torch.equal(layer.bias.grad, ref.bias.grad)


def test_a_weight_that_is_not_a_leaf_or_an_input_without_grad_gets_its_gradient_at_once():
    weight = torch.randn(6, 4, requires_grad=True)
    work = []
    with defer_weight_grads(work):
        y = linear(torch.randn(2, 4, requires_grad=True), weight[2:4])  # a slice, as ReplicatedKVLinear uses
        z = linear(torch.randn(2, 4), weight)  # no input gradient: deferring would cut the graph
    (y.sum() + z.sum()).backward()
    assert work == [] and weight.grad is not None and weight.grad[:2].abs().sum() > 0


def test_nested_deferral_restores_the_outer_list_and_nothing_is_recorded_outside():
    outer, inner, layer = [], [], Linear(4, 4)
    x = torch.randn(1, 4, requires_grad=True)
    with defer_weight_grads(outer):
        with defer_weight_grads(inner):
            a = layer(x)
        b = layer(x)
    c = layer(x)  # outside: plain F.linear
    (a.sum() + b.sum() + c.sum()).backward()
    assert len(inner) == 1 and len(outer) == 1
    ref = layer.weight.grad.clone()  # c's weight gradient only
    apply_weight_grads(inner)
    apply_weight_grads(outer)
    torch.testing.assert_close(layer.weight.grad, 3 * ref)
