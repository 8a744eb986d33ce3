"""Linears of one input under fp8 (fp8.fp8_linears): the attention's wq, wk, wv and a gated MLP's gate and up
quantise their input once and save one float8 copy of it for backward, where one call per linear did each
(the H200's profile of fp8 + compile on the gpt-1b model showed three casts of the first norm's output a
layer). Outputs and weight gradients are those of one call per linear."""
import pytest
import torch

from pipetrain.kernels import fp8_quant
from pipetrain.parallel.tensor import fp8
from tests.unit.common import GPT2, LLAMA, build_trainer


def _first_block(cfg, out, precision):
    out.mkdir()
    return build_trainer(cfg, str(out), precision=precision, steps=1).model.layers["0"]


def test_attention_and_a_gated_mlp_share_their_input_only_under_fp8(tmp_path):
    llama = _first_block(LLAMA, tmp_path / "llama", "fp8")
    assert llama.attn.shared_input is fp8.fp8_linears and llama.mlp.shared_input is fp8.fp8_linears
    gpt2 = _first_block(GPT2, tmp_path / "gpt2", "fp8")
    assert gpt2.attn.shared_input is fp8.fp8_linears
    assert gpt2.mlp.shared_input is None  # no gate: up is the only linear of its input
    bf16 = _first_block(LLAMA, tmp_path / "bf16", "bf16")
    assert bf16.attn.shared_input is None and bf16.mlp.shared_input is None


def _run(linears, x, shared, monkeypatch):
    """Forward and backward of linears on x under bf16 autocast; returns outputs, x's and the weights' gradients,
    the float8 quantisations of an x-shaped tensor and the float8 x-shaped tensors saved for backward."""
    for linear in linears:
        linear.weight.grad = None
    quantised, saved = [], []
    real = fp8_quant.quantize  # quantize_tensorwise's reference, which a linear's quantisation runs on the CPU

    def counting(t, scale, dtype):
        if t.shape == (x.numel() // x.shape[-1], x.shape[-1]) and dtype == fp8.FORWARD_DTYPE:
            quantised.append(t)
        return real(t, scale, dtype)

    def pack(t):
        if t.dtype == fp8.FORWARD_DTYPE and t.shape[-1] == x.shape[-1] and t.numel() == x.numel():
            saved.append(t)
        return t

    monkeypatch.setattr(fp8_quant, "quantize", counting)
    xi = x.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
        outs = fp8.fp8_linears(xi, linears) if shared else tuple(linear(xi) for linear in linears)
    torch.manual_seed(1)
    sum((out.float() * torch.randn(out.shape)).sum() for out in outs).backward()
    monkeypatch.setattr(fp8_quant, "quantize", real)
    return outs, xi.grad, [linear.weight.grad.clone() for linear in linears], len(quantised), len(saved)


def test_the_input_is_quantised_and_saved_once_with_the_results_of_one_call_per_linear(tmp_path, monkeypatch):
    block = _first_block(LLAMA, tmp_path / "run", "fp8")
    torch.manual_seed(0)
    x = torch.randn(3, 5, LLAMA.d_model) * 2  # 15 rows: no weight of the block has that shape
    for module, names in ((block.attn, ("wq", "wk", "wv")), (block.mlp, ("gate", "up"))):
        linears = tuple(getattr(module, name) for name in names)
        outs, dx, dws, quantised, saved = _run(linears, x, True, monkeypatch)
        want_outs, want_dx, want_dws, per_linear_quantised, per_linear_saved = _run(linears, x, False, monkeypatch)
        assert (quantised, saved) == (1, 1) and (per_linear_quantised, per_linear_saved) == (len(names),) * 2
        for got, want in zip([*outs, *dws], [*want_outs, *want_dws]):
            torch.testing.assert_close(got, want, rtol=0.0, atol=0.0)
        # x's gradient sums the linears' parts: here in order, there in autograd's (fp32: round-off)
        torch.testing.assert_close(dx, want_dx, rtol=1e-6, atol=1e-7)



def test_an_output_nothing_uses_gives_its_weight_no_gradient():
    """As a linear called on its own and left unused: None, not zeros (autograd would hand the function a
    zero gradient for that output, which it would quantise and multiply)."""
    linears = tuple(torch.nn.Linear(32, 16, bias=False) for _ in range(2))
    for linear in linears:
        linear.fp8 = fp8.Fp8Linear()
    x = torch.randn(5, 32, requires_grad=True)
    first, _ = fp8.fp8_linears(x, linears)
    first.square().sum().backward()
    assert linears[0].weight.grad is not None and linears[1].weight.grad is None
    alone = x.detach().clone().requires_grad_()
    linears[0].fp8(alone, linears[0].weight).square().sum().backward()
    torch.testing.assert_close(x.grad, alone.grad, rtol=0.0, atol=0.0)


@pytest.mark.slow
def test_inductor_compiles_the_shared_input_on_the_scaled_mm_path_to_eager_values():
    """Inductor with the hardware path (torch._scaled_mm runs on the CPU too) over three linears of one input,
    one with a bias: its outputs and every gradient are eager's."""
    torch.manual_seed(0)
    spec = fp8.Fp8Linear(hardware=True)
    linears = tuple(torch.nn.Linear(64, n, bias=bias) for n, bias in ((48, False), (32, True), (48, False)))
    for linear in linears:
        linear.weight.data.mul_(0.05)
        linear.fp8 = spec
    x = torch.randn(4, 16, 64) * 3

    def run(fn):
        for linear in linears:
            linear.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        outs = fn(xi)
        sum(out.square().sum() for out in outs).backward()
        return [*(out.detach() for out in outs), xi.grad, *(linear.weight.grad.clone() for linear in linears),
                linears[1].bias.grad.clone()]

    def forward(xi):
        return fp8.fp8_linears(xi, linears)

    eager = run(forward)
    compiled = run(torch.compile(forward, backend="inductor", fullgraph=True))
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
