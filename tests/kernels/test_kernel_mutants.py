"""The Triton kernels (interpreted) on the inputs where a small slip shows: all-zero rows, bf16 rounding checked
against float64, vocabulary shards' edges, an incoming loss gradient other than 1.

Mutants these tests kill (each survived the existing tests of its module):

  N04  RMSNorm's forward kernel without eps (a zero row, a padded position, gives NaN instead of 0)
  N06  RMSNorm's forward storing x * rstd * w truncated to bf16 (the interpreter's cast), not rounded to nearest
  E02  cross-entropy's shard test local_t <= V: a target at the next shard's first column read past the row
  W04  SwiGLU's forward rounding silu(g) * u once, not silu(g) first as torch's bf16 ops do
  X02  PIPETRAIN_KERNELS taken verbatim (" Torch" or "AUTO" refused)
  G02  (also; tests/dist/test_compile.py's ep2 case counts its graphs, in seconds more) models/compile.compiled_pieces
       leaving a MoE block's shared expert eager under expert parallelism
"""
from __future__ import annotations

import pytest
import torch

from pipetrain.kernels.rms_norm import RMSNormFn, rms_norm_ref
from tests.kernels.common import fresh_seed, randn


def _ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at each |x| (float64): 2^(exponent - 7)."""
    return torch.ldexp(torch.ones_like(x), torch.frexp(x.abs())[1] - 8)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_of_an_all_zero_row_is_zero_and_its_gradient_finite(poisoned, dtype):
    """x = 0: rstd = 1/sqrt(eps), y = 0 (a padded position's hidden state), dx = rstd * dy * w, finite."""
    seed = fresh_seed()
    x = randn(seed, 3, 40, dtype=dtype)
    x[1] = 0
    w = randn(seed + 1, 40, dtype=dtype) + 1
    dy = randn(seed + 2, 3, 40, dtype=dtype)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = RMSNormFn.apply(xl, wl, 1e-5, dtype)
    y.backward(dy)
    assert torch.equal(y[1], torch.zeros(40, dtype=dtype)), f"seed={seed}: {y[1]}"
    want = (dy[1].double() * w.double() / 1e-5 ** 0.5)
    torch.testing.assert_close(xl.grad[1].double(), want, rtol=1e-5 if dtype == torch.float32 else 2 ** -7,
                               atol=1e-6, msg=lambda m: f"seed={seed}: {m}")
    assert torch.isfinite(wl.grad).all()


@pytest.mark.triton
def test_rms_norm_rounds_its_bf16_output_to_nearest(poisoned):
    """y in bf16 is the fp32 result rounded to nearest: within half an ulp of the float64 value (plus fp32's
    round-off), where truncation is off by up to a whole ulp."""
    seed = fresh_seed()
    x = randn(seed, 64, 96, scale=2.0)
    w = randn(seed + 1, 96) + 1
    y = RMSNormFn.apply(x, w, 1e-6, torch.bfloat16).double()
    exact = rms_norm_ref(x.double(), w.double(), 1e-6)
    err = (y - exact).abs() / _ulp_bf16(exact)
    assert err.max() <= 0.5 + 1e-3, f"seed={seed}: {err.max():.3f} ulp"


@pytest.mark.triton
def test_a_vocabulary_shard_takes_only_its_own_targets_logits(poisoned):
    """Shards [0, 8) and [8, 16) of a 16-column vocabulary: a target of exactly 8, the next shard's first column,
    has no logit in shard 0 (0 there) and its logit in shard 1; the two shards' target logits sum to the
    whole row's."""
    from pipetrain.kernels.cross_entropy import cross_entropy_fwd
    seed = fresh_seed()
    logits = randn(seed, 5, 16)
    targets = torch.tensor([8, 7, 8, 0, 15])
    got = [cross_entropy_fwd(logits[:, lo:lo + 8].contiguous(), targets, -100, lo)[2] for lo in (0, 8)]
    want = logits.gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(got[0], torch.where(targets < 8, want, 0.0), rtol=0, atol=0, msg=f"seed={seed}")
    torch.testing.assert_close(got[0] + got[1], want, rtol=0, atol=0, msg=f"seed={seed}")


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


@pytest.mark.triton
def test_swiglu_rounds_silu_to_bf16_before_the_product_as_torch_s_bf16_ops_do(poisoned):
    """y = bf16(bf16(silu(g)) * u) in bf16, as F.silu(gate) * up rounds in bf16: against that computed in
    float64 nearly every element is equal (an fp32 sigmoid lands on the other side of a rounding boundary
    rarely); rounding silu's product only once differs in a large share of them."""
    from pipetrain.kernels.swiglu import SwiGLUFn
    seed = fresh_seed()
    g, u = (randn(seed + i, 64, 160, dtype=torch.bfloat16, scale=3.0) for i in range(2))
    y = SwiGLUFn.apply(g, u).double()
    g64, u64 = g.double(), u.double()
    want = _bf16(_bf16(g64 * torch.sigmoid(g64)) * u64)
    equal = (y == want).double().mean().item()
    assert equal > 0.99, f"seed={seed}: {equal:.4f} of the elements equal"


def test_the_kernel_mode_ignores_case_and_surrounding_spaces(monkeypatch):
    from pipetrain.kernels.dispatch import kernel_mode, use_triton
    monkeypatch.setenv("PIPETRAIN_KERNELS", " Torch\n")
    assert kernel_mode() == "torch" and not use_triton(torch.zeros(1))
    monkeypatch.setenv("PIPETRAIN_KERNELS", "AUTO")
    assert kernel_mode() == "auto"


def test_expert_parallel_compiles_a_moe_block_s_shared_expert_with_its_norms_and_attention():
    """models/compile.compiled_pieces: a MoE block compiles its norms, its attention and its shared expert (the
    dispatch, the routed experts and the router run eagerly); a dense block compiles whole."""
    from pipetrain.models import build
    from pipetrain.models.compile import compiled_pieces
    from tests.unit.common import LLAMA, TINY_MOE
    moe = build(TINY_MOE).layers["0"]
    assert set(compiled_pieces(moe)) == {"attn_norm", "attn", "mlp_norm", "mlp.shared"}
    assert compiled_pieces(moe)["mlp.shared"] is moe.mlp.shared
    dense = build(LLAMA).layers["0"]
    assert compiled_pieces(dense) == {"": dense}
