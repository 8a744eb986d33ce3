"""grads.step_on_device: the fused AdamW step skips itself when either the norm or the loss is not
finite, each on its own. tests/unit/test_step_on_device.py makes both NaN at once (a NaN weight), so a check
that read only one of the two passed it."""
import pytest
import torch

from pipetrain.parallel.data.grads import clip_divisor, step_on_device


def _fused_adamw():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    opt = torch.optim.AdamW(params, lr=0.1, fused=True)
    for p in params:
        p.grad = torch.randn_like(p)
    return params, opt


@pytest.mark.parametrize("norm, loss_sum", [(1.0, float("nan")), (1.0, float("inf")), (float("nan"), 3.0),
                                            (float("inf"), 3.0)],
                         ids=["nan-loss", "inf-loss", "nan-norm", "inf-norm"])
def test_a_non_finite_norm_or_loss_alone_leaves_weights_and_moments_as_they_were(norm, loss_sum):
    params, opt = _fused_adamw()
    before = [p.detach().clone() for p in params]
    step_on_device([opt], opt.step, torch.tensor(norm), 0.5, torch.tensor(loss_sum))
    for p, b in zip(params, before):
        torch.testing.assert_close(p.detach(), b, rtol=0, atol=0)
    for state in opt.state.values():  # no moment and no step counter moved
        assert float(state["step"]) == 0.0
        assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")


def test_finite_norm_and_loss_step_the_weights():
    params, opt = _fused_adamw()
    before = [p.detach().clone() for p in params]
    step_on_device([opt], opt.step, torch.tensor(1.0), 0.5, torch.tensor(3.0))
    assert all(not torch.equal(p.detach(), b) for p, b in zip(params, before))


def test_the_clip_divisor_is_norm_over_max_norm_only_past_max_norm():
    torch.testing.assert_close(clip_divisor(torch.tensor(2.0), 0.5), torch.tensor((2.0 + 1e-6) / 0.5))
    assert float(clip_divisor(torch.tensor(0.25), 0.5)) == 1.0
    assert clip_divisor(torch.tensor(2.0), 0.0) is None
