"""Rowwise fp8 linears of one input: fp8.fp8_linears with rowwise specs (the attention's wq, wk, wv and a
gated MLP's gate and up under train.fp8_recipe=rowwise or rowwise_with_gw_hp) gives x the sum of every linear's
dx, as one call per linear does. tests/unit/test_fp8_one_input.py compares the two for tensorwise specs only;
rowwise_backward keeping only the last linear's dx passed every test."""
import pytest
import torch

from pipetrain.parallel.tensor import fp8


def _linears(n, recipe):
    torch.manual_seed(0)
    linears = tuple(torch.nn.Linear(32, 16, bias=i == 0) for i in range(n))
    for linear in linears:
        linear.fp8 = fp8.Fp8Linear(rowwise=recipe != "tensorwise", weight_grad_hp=recipe == "rowwise_with_gw_hp")
    return linears


def _grads(linears, x, g, shared):
    for linear in linears:
        linear.weight.grad = None
    xi = x.clone().requires_grad_()
    outs = fp8.fp8_linears(xi, linears) if shared else tuple(linear.fp8(xi, linear.weight, linear.bias)
                                                            for linear in linears)
    sum((out * gi).sum() for out, gi in zip(outs, g)).backward()
    return outs, xi.grad, [linear.weight.grad.clone() for linear in linears]


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp", "tensorwise"])
@pytest.mark.parametrize("n", [2, 3])
def test_the_input_gradient_of_linears_of_one_input_sums_every_linears_part(recipe, n):
    linears = _linears(n, recipe)
    torch.manual_seed(1)
    x = torch.randn(3, 5, 32) * 2
    g = [torch.randn(3, 5, 16) for _ in range(n)]
    outs, dx, dws = _grads(linears, x, g, shared=True)
    want_outs, want_dx, want_dws = _grads(linears, x, g, shared=False)
    for got, want in zip([*outs, *dws], [*want_outs, *want_dws]):
        torch.testing.assert_close(got, want, rtol=0.0, atol=0.0)
    torch.testing.assert_close(dx, want_dx, rtol=1e-6, atol=1e-6)
    # and each linear's part matters: the last one's alone is not the gradient
    _, last_dx, _ = _grads(linears[-1:], x, g[-1:], shared=True)
    assert not torch.allclose(dx, last_dx, rtol=1e-3, atol=1e-3)
