"""The mixture-of-experts layer (pipetrain/models/moe.py): routing, dropless compute, aux loss, the
aux-free bias, and a few single-process training steps of a tiny MoE."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipetrain.config import DataConfig, ModelConfig, ParallelConfig, Recipe, TrainConfig, validate
from pipetrain.generate.load import latest_checkpoint, model_from_checkpoint
from pipetrain.models import build, count_params, flops_per_token, materialize
from pipetrain.models.moe import MoE, grouped_swiglu, grouped_swiglu_loop, moe_step_end, route_topk
from pipetrain.parallel.mesh.rules import layout_problems, parallel_problems
from pipetrain.plan.shapes import model_params
from tests.unit.common import build_trainer, patch_torch_op

MOE = ModelConfig(family="mixtral", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  max_seq_len=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
QWEN3_MOE = ModelConfig(family="qwen3_moe", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                        max_seq_len=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                        shared_expert_intermediate_size=16)


def _moe(cfg=MOE, seed=0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
    return moe


def dense_reference(moe: MoE, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
    """Per token, sum over its k experts of w * SwiGLU_e(x): no sorting, no grouping."""
    e = moe.experts
    rows = []
    for n, xt in enumerate(x.reshape(-1, x.shape[-1])):
        out = torch.zeros_like(xt)
        for j in range(topk_idx.shape[1]):
            i = int(topk_idx[n, j])
            out = out + topk_w[n, j] * (e.down[i] @ (F.silu(e.gate[i] @ xt) * (e.up[i] @ xt)))
        rows.append(out)
    return torch.stack(rows).view(x.shape)


def test_moe_output_equals_dense_per_token_reference():
    moe = _moe()
    x = torch.randn(3, 5, 32)
    idx, w, _ = moe.route(x)
    torch.testing.assert_close(moe(x), dense_reference(moe, x, idx, w), rtol=1e-5, atol=1e-6)


def test_a_shared_expert_adds_its_swiglu_of_every_token():
    """model.shared_expert_intermediate_size: an always-on SwiGLU MLP beside the routed experts (docs/models.md),
    its output added for every token. No reference checked it (transformers' MoE families here have none, and
    the layouts compare with a single process that shares it): its output multiplied by 0 passed test_moe,
    test_moe_hf and test_compile."""
    model = materialize(build(QWEN3_MOE), QWEN3_MOE, 0, "cpu").eval()
    moe = model.layers["0"].mlp
    s = moe.shared
    assert s is not None and s.gate.weight.shape == (QWEN3_MOE.shared_expert_intermediate_size, QWEN3_MOE.d_model)
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(0))
    dy = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(1))
    got_x, want_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    idx, w, _ = moe.route(want_x)
    shared = F.linear(F.silu(F.linear(want_x, s.gate.weight)) * F.linear(want_x, s.up.weight), s.down.weight)
    routed = dense_reference(moe, want_x, idx, w)
    assert shared.abs().max() > 1e-3 * routed.abs().max()  # large enough to show
    got = moe(got_x)
    torch.testing.assert_close(got, routed + shared, rtol=1e-5, atol=1e-6)
    (got * dy).sum().backward()
    ((routed + shared) * dy).sum().backward()  # and the input's gradient through the shared expert too
    torch.testing.assert_close(got_x.grad, want_x.grad, rtol=1e-5, atol=1e-6)


def test_every_token_to_one_expert_drops_no_token():
    moe = _moe()
    with torch.no_grad():  # a router that prefers expert 2 for every token, by a wide margin
        moe.router.weight.zero_()
    x = torch.randn(2, 6, 32)
    x[..., 0] = 1.0
    with torch.no_grad():
        moe.router.weight[2, 0] = 50.0
        moe.router.weight[1, 0] = 20.0
    idx, w, _ = moe.route(x)
    assert (idx[:, 0] == 2).all() and (idx[:, 1] == 1).all()
    assert int(torch.bincount(idx.reshape(-1), minlength=4)[0]) == 0  # experts 0 and 3 receive nothing
    torch.testing.assert_close(moe(x), dense_reference(moe, x, idx, w), rtol=1e-5, atol=1e-6)


def test_ties_choose_the_lower_expert_index():
    probs = torch.full((3, 4), 0.25)
    idx, w = route_topk(probs, 2, norm=False)
    assert idx.tolist() == [[0, 1]] * 3
    torch.testing.assert_close(w, torch.full((3, 2), 0.25))


def test_bias_chooses_experts_but_weights_stay_the_probabilities():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    idx, w = route_topk(probs, 2, norm=False, bias=torch.tensor([0.0, 0.0, 0.5, 0.0]))
    assert idx.tolist() == [[2, 0]]
    torch.testing.assert_close(w, torch.tensor([[0.2, 0.4]]))
    _, w = route_topk(probs, 2, norm=True)
    torch.testing.assert_close(w, torch.tensor([[0.4 / 0.7, 0.3 / 0.7]]))


def test_grouped_swiglu_matches_the_loop_with_empty_experts():
    gate, up, down = torch.randn(4, 8, 6), torch.randn(4, 8, 6), torch.randn(4, 6, 8)
    counts = torch.tensor([3, 0, 5, 0])
    x = torch.randn(8, 6)
    ref = torch.cat([F.linear(F.silu(F.linear(x[:3], gate[0])) * F.linear(x[:3], up[0]), down[0]),
                     F.linear(F.silu(F.linear(x[3:], gate[2])) * F.linear(x[3:], up[2]), down[2])])
    torch.testing.assert_close(grouped_swiglu(x, counts, gate, up, down), ref)
    torch.testing.assert_close(grouped_swiglu_loop(x, counts.tolist(), gate, up, down), ref)


def test_grouped_linear_op_matches_the_loop_in_gradients_and_passes_opcheck():
    """The experts' GEMMs off CUDA are the custom op pipetrain::grouped_linear (one node of static shape in a
    compiled block, models/moe.py): its dx and dW ops against autograd through the per-expert loop, with
    empty experts first, inside and last; torch.library.opcheck checks its schema, fake kernel and autograd."""
    from pipetrain.models.moe import grouped_linear
    torch.manual_seed(0)
    counts = torch.tensor([0, 3, 0, 5, 0])
    leaves = [torch.randn(8, 6), torch.randn(5, 8, 6), torch.randn(5, 8, 6), torch.randn(5, 6, 8)]
    results = []
    for op in (True, False):
        x, gate, up, down = [t.clone().requires_grad_() for t in leaves]
        y = grouped_swiglu(x, counts, gate, up, down) if op else grouped_swiglu_loop(x, counts.tolist(), gate,
                                                                                      up, down)
        (y * torch.arange(y.numel()).view_as(y)).sum().backward()
        results.append([y, x.grad, gate.grad, up.grad, down.grad])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    assert results[0][2][[0, 2, 4]].eq(0).all()  # an empty expert's weights get a zero gradient
    x, w = torch.randn(8, 6, requires_grad=True), torch.randn(5, 4, 6, requires_grad=True)
    torch.library.opcheck(grouped_linear, (x, w, torch.cumsum(counts, 0)))


def test_the_grouped_mm_path_matches_the_loop_in_values_and_gradients(monkeypatch):
    """torch._grouped_mm runs on the CPU too (torch 2.11 and 2.13), so the CUDA path's offsets and transposed
    weight views are checked here with its condition forced: bf16, empty experts, forward and backward."""
    from pipetrain.models import moe
    torch.manual_seed(0)
    E, D, Fh = 4, 16, 32
    counts = torch.tensor([10, 0, 14, 0])
    leaves = [torch.randn(24, D), torch.randn(E, Fh, D), torch.randn(E, Fh, D), torch.randn(E, D, Fh)]
    real, calls, real_ok = torch._grouped_mm, [], moe._grouped_mm_ok
    patch_torch_op(monkeypatch, "_grouped_mm", lambda *a, **k: calls.append(k["offs"].tolist()) or real(*a, **k))
    # the losses: one whose gradient is a tensor of its own, and plain sums, whose gradients are expanded
    # (stride 0) or transposed views, which torch._grouped_mm's backward refuses unless made contiguous
    losses = {"square": lambda y: y.float().square().sum(), "sum": lambda y: y.sum(),
              "transposed": lambda y: (y.t() * torch.arange(y.shape[0], dtype=y.dtype)).sum()}
    for name, loss in losses.items():
        results, calls[:] = {}, []
        for grouped in (True, False):
            monkeypatch.setattr(moe, "_grouped_mm_ok", lambda x, gate: grouped)
            x, gate, up, down = [t.to(torch.bfloat16).requires_grad_() for t in leaves]
            y = grouped_swiglu(x, counts, gate, up, down)
            loss(y).backward()
            results[grouped] = [y, x.grad, gate.grad, up.grad, down.grad]
        assert calls == [[10, 10, 24, 24]] * 3, name  # gate, up, down: one grouped GEMM each, cumulative offsets
        for got, want in zip(results[True], results[False]):  # the same bf16 products; bf16's ulp allowed
            torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item(), msg=name)
    assert not real_ok(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(1, 8, 8, dtype=torch.bfloat16))  # CPU


def test_the_grouped_mm_path_takes_autocasts_bf16_from_fp32_masters(monkeypatch):
    """Training keeps fp32 expert weights under bf16 autocast, which has no rule for torch._grouped_mm: the
    grouped path casts the operands itself, as autocast does to the loop's F.linear, and matches the loop
    (the CUDA condition forced to its dtype part; before, fp32 masters always fell back to the loop)."""
    from pipetrain.models import moe
    torch.manual_seed(0)
    E, D, Fh = 4, 16, 32
    counts = torch.tensor([10, 0, 14, 0])
    leaves = [torch.randn(24, D), torch.randn(E, Fh, D), torch.randn(E, Fh, D), torch.randn(E, D, Fh)]
    real, calls = torch._grouped_mm, []
    patch_torch_op(monkeypatch, "_grouped_mm", lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    results = {}
    for grouped in (True, False):
        monkeypatch.setattr(moe, "_grouped_mm_ok",
                            lambda x, gate: grouped and moe._gemm_dtype(x, gate) == torch.bfloat16)
        x, gate, up, down = [t.clone().requires_grad_() for t in leaves]
        with torch.autocast("cpu", torch.bfloat16):
            y = grouped_swiglu(x, counts, gate, up, down)
        y.float().square().sum().backward()
        results[grouped] = [y, x.grad, gate.grad, up.grad, down.grad]
    assert calls == [torch.bfloat16] * 3, calls
    for got, want in zip(results[True], results[False]):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())


class _BlackwellGroupedMM(torch.autograd.Function):
    """torch._grouped_mm as it behaves on Blackwell (pytorch/pytorch#172439): the right forward and dx, and
    a weight gradient whose empty groups' slices hold what the memory held (NaN here)."""

    @staticmethod
    def forward(ctx, a, b, offs):
        ctx.save_for_backward(a, b, offs)
        return _REAL_GROUPED_MM(a, b, offs=offs)

    @staticmethod
    def backward(ctx, dy):
        a, b, offs = ctx.saved_tensors
        with torch.enable_grad():
            a2, b2 = a.detach().requires_grad_(), b.detach().requires_grad_()
            da, db = torch.autograd.grad(_REAL_GROUPED_MM(a2, b2, offs=offs), (a2, b2), dy)
        rows = torch.diff(offs, prepend=offs.new_zeros(1))
        return da, db.masked_fill((rows == 0).view(-1, 1, 1), float("nan")), None


_REAL_GROUPED_MM = torch._grouped_mm


def test_an_expert_no_token_chose_gets_a_zero_gradient_where_grouped_mm_leaves_it_unwritten(monkeypatch):
    """On Blackwell torch._grouped_mm's backward leaves an empty group's weight gradient unwritten; the
    grouped path then zeroes those slices itself (models/moe.py), in bf16 and in fp8's dW (fp8_experts.py).
    The card's behaviour is simulated with NaN; with the guard off the NaN reaches the gradients."""
    from pipetrain.models import moe
    from pipetrain.parallel.tensor import fp8_experts
    torch.manual_seed(0)
    E, D, Fh = 4, 16, 32
    counts = torch.tensor([0, 10, 0, 14])
    leaves = [torch.randn(24, D), torch.randn(E, Fh, D), torch.randn(E, Fh, D), torch.randn(E, D, Fh)]
    monkeypatch.setattr(moe, "_grouped_mm_ok", lambda x, gate: True)
    patch_torch_op(monkeypatch, "_grouped_mm", lambda a, b, offs: _BlackwellGroupedMM.apply(a, b, offs))
    grads = {}
    for guard in (True, False):
        monkeypatch.setattr(moe, "grouped_mm_leaves_empty_groups", lambda device: guard)
        x, gate, up, down = [t.to(torch.bfloat16).requires_grad_() for t in leaves]
        grouped_swiglu(x, counts, gate, up, down).float().square().sum().backward()
        grads[guard] = [gate.grad, up.grad, down.grad]
    x, gate, up, down = [t.to(torch.bfloat16).requires_grad_() for t in leaves]
    grouped_swiglu_loop(x, counts.tolist(), gate, up, down).float().square().sum().backward()
    for got, want in zip(grads[True], [gate.grad, up.grad, down.grad]):
        assert got[[0, 2]].eq(0).all()
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())
    assert all(g[[0, 2]].isnan().all() for g in grads[False])  # what the guard is for
    # fp8's dW: torch._grouped_mm's 2-D x 2-D form called directly
    monkeypatch.setattr(fp8_experts, "grouped_mm_weight_grad_ok", lambda dy, x: True)
    dy, xs, offs = torch.randn(24, Fh).bfloat16(), torch.randn(24, D).bfloat16(), torch.cumsum(counts, 0)
    patch_torch_op(monkeypatch, "_grouped_mm", lambda a, b, offs: _REAL_GROUPED_MM(a, b, offs=offs).index_fill(
        0, torch.tensor([0, 2]), float("nan")))
    for guard in (True, False):
        monkeypatch.setattr(fp8_experts, "grouped_mm_leaves_empty_groups", lambda device: guard)
        dw = fp8_experts.grouped_weight_grad(dy, xs, offs, E)
        assert dw[[0, 2]].eq(0).all() if guard else dw[[0, 2]].isnan().all()
        torch.testing.assert_close(dw[[1, 3]].float(), torch.stack([dy[:10].float().t() @ xs[:10].float(),
                                                                    dy[10:].float().t() @ xs[10:].float()]),
                                   rtol=2 ** -7, atol=0.1)
    assert not moe.grouped_mm_leaves_empty_groups(torch.device("cpu"))


def _explicit_aux(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The per-sequence balance loss written out: mean over sequences of E/(kT) sum_e count_e * mean_t p_e."""
    probs = F.softmax(moe.router(x), dim=-1, dtype=torch.float32)  # (B, T, E)
    idx, _ = route_topk(probs.reshape(-1, moe.num_experts), moe.top_k, moe.norm_topk)
    B, T, E = probs.shape
    onehot = F.one_hot(idx.reshape(B, T * moe.top_k), E).sum(1).float()  # (B, E)
    return (onehot * E / (moe.top_k * T) * probs.mean(1)).sum(-1).mean()


def test_aux_gradient_matches_autograd_of_the_explicit_loss():
    cfg = ModelConfig(**{**MOE.__dict__, "router_aux_loss_coef": 0.3})
    moe, ref = _moe(cfg), _moe(MOE)  # the same weights; ref injects nothing, its loss adds the sum
    moe.train()
    x = torch.randn(3, 5, 32)
    moe(x).sum().backward()
    (ref(x).sum() + 0.3 * _explicit_aux(ref, x)).backward()
    for (name, p), q in zip(moe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert moe.router.weight.grad is not None


@pytest.mark.parametrize("microbatches", [1, 2])
def test_the_logged_aux_loss_is_the_coefficient_times_the_layers_mean_balance(tmp_path, microbatches):
    """The step's "aux_loss": router_aux_loss_coef x the sum over layers of the per-sequence balance averaged
    over the global batch's sequences, each balance written out from the layer's input (_explicit_aux). Only
    aux_loss > 0 was checked (and layouts against a single process), so a sum over the sequences instead of
    their mean passed."""
    cfg = ModelConfig(**{**QWEN3_MOE.__dict__, "router_aux_loss_coef": 0.01})
    trainer = build_trainer(cfg, str(tmp_path), steps=1, global_batch=4, seq_len=16, microbatches=microbatches)
    sums = []

    def explicit(module, args, out):
        with torch.no_grad():  # the mean over this microbatch's sequences, times them
            sums.append(float(_explicit_aux(module, args[0])) * args[0].shape[0])
    hooks = [block.mlp.register_forward_hook(explicit) for block in trainer.model.layers.values()]
    record = trainer.train_step()
    for hook in hooks:
        hook.remove()
    assert len(sums) == cfg.n_layers * microbatches
    assert record["aux_loss"] == pytest.approx(0.01 * sum(sums) / 4, rel=1e-5)


def test_aux_free_bias_moves_toward_balance():
    cfg = ModelConfig(**{**MOE.__dict__, "router_bias_update_rate": 0.01})
    model = materialize(build(cfg), cfg, 0, "cpu").train()
    router = model.layers["0"].mlp.router
    with torch.no_grad():
        router.weight.zero_()
        router.weight[3] = 0.5  # expert 3 wins for every token with a positive mean
    x = torch.randint(0, 64, (4, 16))
    assert not router.expert_bias.any()
    model(x)
    counts = router.step_counts.clone()
    record = moe_step_end(model, lambda t: t)
    over = counts > counts.mean()
    assert over.any() and (router.expert_bias[over] < 0).all() and (router.expert_bias[~over] > 0).all()
    # the step is the rate times the sign, whatever the imbalance (a step proportional to it passed the signs)
    assert torch.equal(router.expert_bias, 0.01 * torch.sign(counts.mean() - counts).float())
    assert router.step_counts.sum() == 0  # reset for the next step
    assert record["expert_load_max"][0] == counts.max() and len(record["expert_load_mean"]) == 2


def test_tiny_moe_trains_and_logs_expert_load(tmp_path):
    cfg = ModelConfig(**{**QWEN3_MOE.__dict__, "router_aux_loss_coef": 0.01, "router_bias_update_rate": 1e-3})
    trainer = build_trainer(cfg, str(tmp_path), learnable=True, steps=6, global_batch=4, seq_len=16)
    history = trainer.fit()
    assert history[-1]["loss"] < history[0]["loss"] * 0.8
    for rec in history:
        assert len(rec["expert_load_max"]) == 2 and rec["aux_loss"] > 0
        # every routed token is counted once per chosen expert: 4 sequences x 16 tokens x k=2 per layer
        assert rec["expert_load_mean"][0] * 4 == 4 * 16 * 2


def test_active_params_and_flops_count_k_of_e_experts():
    model = build(QWEN3_MOE)
    total, active = count_params(model), count_params(model, active=True)
    experts = 2 * 3 * 4 * 24 * 32
    assert total - active == experts // 2  # k=2 of E=4 experts are active
    dense = ModelConfig(**{**QWEN3_MOE.__dict__, "num_experts": 0, "family": "llama", "ffn_hidden": 2 * 24 + 16})
    moe_router_flops = 3 * 2 * 2 * 32 * 4  # L x (fwd+bwd 3) x 2 FLOPs x D x E
    assert flops_per_token(QWEN3_MOE, 16) == flops_per_token(dense, 16) + moe_router_flops


def test_moe_config_errors_are_one_line_each():
    base = Recipe(model=MOE, data=DataConfig(path="x", tokenizer="y"), train=TrainConfig(seq_len=16))
    bad = Recipe(model=ModelConfig(**{**MOE.__dict__, "num_experts_per_tok": 5}), data=base.data)
    assert any("model.num_experts_per_tok: must be in 1..model.num_experts=4, got 5" in p for p in validate(bad))
    compiled = Recipe(model=MOE, data=base.data, train=TrainConfig(seq_len=16, compile=True))
    assert not parallel_problems(compiled)  # experts compile (tests/unit/test_compile.py), under ep piece by piece
    assert not parallel_problems(Recipe(model=MOE, data=base.data, train=compiled.train, parallel=ParallelConfig(ep=2)))
    assert not validate(base, parallel_problems)


def test_planner_counts_every_expert_parameter():
    for cfg in (MOE, QWEN3_MOE):
        assert model_params(cfg) == count_params(build(cfg))


def test_resume_restores_the_aux_free_bias_bitwise(tmp_path):
    cfg = ModelConfig(**{**QWEN3_MOE.__dict__, "router_bias_update_rate": 1e-2, "head_dim_": 12})
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    straight = build_trainer(cfg, str(tmp_path / "a"), steps=5, global_batch=4, seq_len=16)
    want = straight.fit()
    first = build_trainer(cfg, str(tmp_path / "b"), steps=5, global_batch=4, seq_len=16)
    for _ in range(3):
        first.train_step()
    first.checkpointer.save(first)
    first.checkpointer.wait()
    resumed = build_trainer(cfg, str(tmp_path / "b"), steps=5, global_batch=4, seq_len=16, resume="auto")
    bias = resumed.model.layers["0"].mlp.router.expert_bias
    # three moves of +-rate: restored from the checkpoint, not initialised at zero
    assert bias.abs().min() > 0 and torch.equal(bias, first.model.layers["0"].mlp.router.expert_bias)
    got = resumed.fit()
    assert [r["loss"] for r in got] == [r["loss"] for r in want[3:]]
    assert torch.equal(bias, straight.model.layers["0"].mlp.router.expert_bias)
    # the whole-model read (generate, the end-of-run sample) takes the bias and the head size too
    whole, _ = model_from_checkpoint(latest_checkpoint(str(tmp_path / "b")))
    assert torch.equal(whole.layers["0"].mlp.router.expert_bias, bias)  # the step-5 checkpoint fit() saved
    assert whole.layers["0"].attn.head_dim == cfg.head_dim != cfg.d_model // cfg.n_heads


def test_lora_on_an_moe_adapts_attention_only_and_freezes_the_experts(tmp_path):
    cfg = ModelConfig(**{**QWEN3_MOE.__dict__, "lora_rank": 4, "lora_alpha": 8.0})
    trainer = build_trainer(cfg, str(tmp_path), learnable=True, steps=4, global_batch=4, seq_len=16, lr=3e-2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    history = trainer.fit()
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all(".attn.w" in n and n.rsplit(".", 1)[-1] in ("lora_A", "lora_B") for n in trained)
    assert {n.split(".attn.")[1].split(".")[0] for n in trained} == {"wq", "wk", "wv", "wo"}
    for n, p in trainer.model.named_parameters():
        if n not in trained:
            assert torch.equal(p, before[n]), f"{n} is frozen and must not change"
    assert history[-1]["loss"] < history[0]["loss"]
    bad = Recipe(model=ModelConfig(**{**cfg.__dict__, "lora_targets": ["gate"]}),
                 data=DataConfig(path="x", tokenizer="y"), train=TrainConfig(seq_len=16))
    assert any("model.lora_targets: qwen3_moe has no projection 'gate'" in p for p in validate(bad))


def test_full_recompute_gives_the_same_losses_and_counts_each_token_once(tmp_path):
    cfg = ModelConfig(**{**QWEN3_MOE.__dict__, "router_aux_loss_coef": 0.05, "router_bias_update_rate": 1e-3})
    runs = []
    for recompute in ("none", "full"):
        (tmp_path / recompute).mkdir()
        trainer = build_trainer(cfg, str(tmp_path / recompute), steps=3, global_batch=4, seq_len=16,
                                recompute=recompute)
        runs.append([(r["loss"], r["aux_loss"], r["grad_norm"], r["expert_load_max"], r["expert_load_mean"])
                     for r in trainer.fit()])
    assert runs[0] == runs[1]


def test_experts_combine_with_the_layout_keys():
    base = Recipe(model=MOE, data=DataConfig(path="x", tokenizer="y"), train=TrainConfig(seq_len=16))
    cp = Recipe(model=MOE, data=base.data, train=base.train, parallel=ParallelConfig(cp=2))
    assert not layout_problems(cp, 2)  # the balance loss sums its counts over cp (tests/dist/test_moe.py)
    # ep groups inside one cp coordinate, experts reduced over expert-dp x cp (tests/dist/test_expert_parallel.py)
    cp_ep = Recipe(model=MOE, data=base.data, train=base.train, parallel=ParallelConfig(cp=2, ep=2))
    assert not layout_problems(cp_ep, 4)
    (line,) = layout_problems(cp_ep, 2)  # dp 1: ep borrows its ranks from dp, not from cp
    assert line.startswith("parallel.ep: must divide dp=1"), line
    assert not layout_problems(Recipe(model=MOE, data=base.data, train=base.train, parallel=ParallelConfig(tp=2)), 2)
    # sequence parallelism composes: the router sees the whole sequence through its gathered logits
    sp = Recipe(model=MOE, data=base.data, train=base.train, parallel=ParallelConfig(tp=2, sequence_parallel=True))
    assert not layout_problems(sp, 2)


def test_a_moe_model_in_bf16_without_autocast_keeps_bf16():
    """Weights and activations all bf16, no autocast (a bf16 copy of a model, as for generation): the routing
    weights follow x, so the block hands back bf16 and the next linear takes it (fp32 weights are for
    autocast, where x is the norm's bf16 output beside an fp32 residual stream)."""
    cfg = ModelConfig(family="mixtral", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      num_experts=4, num_experts_per_tok=2, max_seq_len=16)
    model = materialize(build(cfg), cfg, seed=0, device="cpu").to(torch.bfloat16)
    logits = model(torch.randint(0, 64, (2, 8)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_zero3_takes_experts_with_and_without_expert_parallelism():
    """ZeRO-3 gathers the stacked experts with their block (tests/dist/test_moe.py), and under ep > 1 this ep
    rank's experts over expert-dp (tests/dist/test_expert_parallel.py): no refusal either way."""
    def problems(**parallel):
        recipe = Recipe(model=MOE, parallel=ParallelConfig(**parallel), train=TrainConfig(global_batch=8, seq_len=16))
        return parallel_problems(recipe) + layout_problems(recipe, 4)
    assert problems(zero=3) == []
    assert problems(zero=3, ep=2) == [] and problems(zero=3, ep=4) == []
