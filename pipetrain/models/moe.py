"""Mixture-of-experts feed-forward: a router, E SwiGLU experts as stacked tensors, an optional shared MLP.

MoE replaces Block.mlp when model.num_experts > 0. One forward is three overridable steps, so expert
parallelism (pipetrain.parallel.expert) replaces only the middle one:

    topk_idx, topk_w, stats = self.route(x)             softmax over all E experts, top-k, renormalise
    y = self.dispatch_compute_combine(x, idx, w)        sort tokens by expert, grouped SwiGLU, unsort, sum
    y = self.account(y, stats)                          aux loss injection, expert counts for the step

Routing follows the Hugging Face families exactly: probabilities = softmax(router logits) in fp32 over
all experts, then the top k, then (norm_topk_prob) divided by their sum, then cast to x's dtype (fp32
under autocast, MoE.route). The
DeepSeek-V3 aux-loss-free bias (router.expert_bias) is added to the probabilities only to choose WHICH
experts a token goes to; the weights stay the unbiased probabilities. Ties choose the lower expert
index (a stable sort), so routing is deterministic.

Dropless: every token is computed by each of its k experts; there is no capacity factor, so no token is
ever dropped or padded (an expert's batch is as large as its routing makes it).

Balance loss, per SEQUENCE (DeepSeek-V3's sequence-wise loss; Switch's with a sequence as the batch):
for each sequence, balance = sum_e f_e * P_e, f_e = E / (k T) * (tokens of the sequence routed to e),
P_e = mean over its T tokens of the probability of e (1 when perfectly balanced). The aux loss is
router_aux_loss_coef * sum over layers of the mean over the global batch's sequences. A sequence is never
split by data or pipeline parallelism (microbatches split the batch by rows), so no layout changes it.
Context parallelism does split it: a cp rank holds T/cp of each sequence's tokens. Its MoE layers then have a
`token_split` (set by pipetrain.parallel.context: sum(t) sums t over the cp ranks, parts = cp): the counts are
summed over cp into the whole sequence's f_e, and each rank's balance is its tokens' share of sum_e f_e * P_e
(their probabilities summed, over the whole sequence's T). The shares sum to the sequence's balance, and each
token's probability gets the gradient f_e / T it gets in one process.
It reaches the gradient through AuxLossInjector on the layer output (Megatron's MoEAuxLossAutoScaler):
forward returns the output unchanged; backward also gives the aux term its gradient, scaled by
1 / aux_sequences (the global batch's sequence count, set by build like the LM loss's 1 / target tokens),
so a pipeline stage needs no loss plumbing.

Step bookkeeping: every training forward adds its routing counts to the non-persistent buffer
router.step_counts (and the detached balance sum to router.step_aux); moe_step_end(model, reduce_fn)
after the optimizer step reduces them, moves the aux-free bias (bias += rate * sign(mean - count)) and
returns the per-layer loads for metrics. A full-recompute forward running again inside backward does
not count twice.

Shapes: N tokens (B*T), D model, E experts, k experts per token, F expert ffn.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipetrain.config import ModelConfig
from pipetrain.kernels import swiglu
from pipetrain.kernels.dispatch import autocast_dtype


class Router(nn.Linear):
    """D -> E logits (an nn.Linear without bias, weight (E, D)), with the aux-free balancing bias."""

    def __init__(self, d_model: int, num_experts: int):
        super().__init__(d_model, num_experts, bias=False)
        # persistent: the bias is training state a checkpoint must restore (fp32 whatever the weights' dtype)
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        # this step's routed tokens per expert and detached per-sequence balance sum (moe_step_end resets)
        self.register_buffer("step_counts", torch.zeros(num_experts, dtype=torch.float64), persistent=False)
        self.register_buffer("step_aux", torch.zeros((), dtype=torch.float64), persistent=False)


class AuxLossInjector(torch.autograd.Function):
    """forward: y unchanged; backward: y's gradient, and `scale` as the gradient of the aux term."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, aux: torch.Tensor, scale: float):
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return dy, torch.full((), ctx.scale, dtype=torch.float32, device=dy.device), None


def route_topk(probs: torch.Tensor, k: int, norm: bool, bias: torch.Tensor | None = None):
    """(topk_idx (N, k) int64, topk_w (N, k) fp32) of probs (N, E) fp32: the k largest of probs (+ bias:
    selection only), lower index first among ties; weights renormalised to sum 1 when norm."""
    score = probs if bias is None else probs + bias
    topk_idx = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :k]
    topk_w = probs.gather(-1, topk_idx)
    if norm:
        topk_w = topk_w / topk_w.sum(-1, keepdim=True)
    return topk_idx, topk_w


def _gemm_dtype(x: torch.Tensor, gate: torch.Tensor) -> torch.dtype | None:
    """The dtype the experts' GEMMs take: autocast's where it is on (it casts the loop's F.linear operands,
    fp32 masters included, and has no rule for torch._grouped_mm), else x's if the weights share it."""
    return autocast_dtype(x) or (x.dtype if gate.dtype == x.dtype else None)


def _grouped_mm_ok(x: torch.Tensor, gate: torch.Tensor) -> bool:
    """torch._grouped_mm's conditions: CUDA sm90+, bf16 GEMMs, rows 16-byte aligned (dims multiples of 8)."""
    return (x.is_cuda and _gemm_dtype(x, gate) == torch.bfloat16
            and hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(x.device) >= (9, 0)
            and x.shape[-1] % 8 == 0 and gate.shape[1] % 8 == 0)


def grouped_mm_leaves_empty_groups(device: torch.device) -> bool:
    """Whether torch._grouped_mm's weight gradient (its 2-D x 2-D form, groups along the summed rows) leaves the
    slice of a group with no rows unwritten on this card, as it does on Blackwell (sm100 and newer: whatever the
    memory held, pytorch/pytorch#172439, open in torch 2.13); Hopper writes zeros. An expert that no token
    chose would get that memory as its gradient."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10


def zero_empty_groups(dw: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """dw (E, N, K) with the slices of the groups that have no rows (offs (E,), cumulative) set to zero: a
    select, not a multiply, since unwritten memory may hold NaN; no read of offs to the host."""
    rows = torch.diff(offs, prepend=offs.new_zeros(1))
    return torch.where((rows > 0).view(-1, 1, 1), dw, torch.zeros((), dtype=dw.dtype, device=dw.device))


class _ZeroEmptyGroupsGrad(torch.autograd.Function):
    """The identity on an (E, N, K) expert weight whose backward zeroes the gradient of the empty groups
    (zero_empty_groups), on cards where torch._grouped_mm's own backward leaves it unwritten."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(offs)
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (offs,) = ctx.saved_tensors
        return zero_empty_groups(grad, offs), None


def grouped_swiglu_loop(x_sorted: torch.Tensor, counts: list[int], gate, up, down) -> torch.Tensor:
    """The reference: one SwiGLU per expert over its contiguous rows. x_sorted (N*k, D) -> (N*k, D)."""
    outs, start = [], 0
    # unbind once: indexing gate[e] per expert would give each expert a backward that writes a zero-filled
    # (E, F, D) gradient (3E full-size buffers per layer); unbind's backward stacks the E pieces once
    gates, ups, downs = gate.unbind(0), up.unbind(0), down.unbind(0)
    for e, n in enumerate(counts):
        if n:
            xe = x_sorted[start:start + n]
            outs.append(F.linear(swiglu(F.linear(xe, gates[e]), F.linear(xe, ups[e])), downs[e]))
            start += n
    if not outs:
        return x_sorted.new_zeros(x_sorted.shape[0], down.shape[1])
    return torch.cat(outs)


class _DenseGrad(torch.autograd.Function):
    """The identity, whose backward hands on its gradient made contiguous. torch._grouped_mm's backward
    refuses a gradient with stride 0 (what `y.sum().backward()` gives: an expanded tensor), and any stride
    that is not 16-byte aligned: "Invalid strides/sizes" (seen on an H100, and on the CPU alike)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _DenseGrad.apply(torch._grouped_mm(a, b, offs=offs))


def grouped_swiglu(x_sorted: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                   down: torch.Tensor, fp8: Callable | None = None) -> torch.Tensor:
    """SwiGLU of each expert over its rows: x_sorted (M, D) sorted by expert, counts (E,) rows per expert,
    gate/up (E, F, D), down (E, D, F) -> (M, D). On CUDA one grouped GEMM per matrix (torch._grouped_mm,
    bf16, with cumulative offsets) where available; else grouped_linear, the loop over experts as one op of
    static shape, which a compiled block can hold (grouped_swiglu_loop is the reference). fp8: the experts'
    float8 grouped GEMM (Experts.fp8_grouped, set by train.precision=fp8: pipetrain.parallel.tensor.fp8_experts),
    called (x, weight, offs, split) with split "out" for gate / up and "in" for down (their tp splits)."""
    if fp8 is not None:
        offs = torch.cumsum(counts, 0)
        return fp8(swiglu(fp8(x_sorted, gate, offs, "out"), fp8(x_sorted, up, offs, "out")), down, offs, "in")
    grouped = _grouped_mm_ok(x_sorted, gate)
    dtype = _gemm_dtype(x_sorted, gate)
    if dtype is not None:  # autocast's cast of the loop's F.linear operands (neither op gets autocast)
        x_sorted, gate, up, down = (t.to(dtype) for t in (x_sorted, gate, up, down))  # no-ops outside autocast
    offs = torch.cumsum(counts, 0)
    if grouped:
        offs = offs.to(torch.int32)
        if grouped_mm_leaves_empty_groups(x_sorted.device):
            gate, up, down = (_ZeroEmptyGroupsGrad.apply(w, offs) for w in (gate, up, down))
        h = swiglu(_grouped_mm(x_sorted, gate.transpose(-2, -1), offs),
                   _grouped_mm(x_sorted, up.transpose(-2, -1), offs))  # (M, F)
        return _grouped_mm(h, down.transpose(-2, -1), offs)
    offs = offs.cpu()  # the loop's one read of the counts: the ops and their backward read this copy
    h = swiglu(grouped_linear(x_sorted, gate, offs), grouped_linear(x_sorted, up, offs))
    return grouped_linear(h, down, offs)


# The experts' GEMMs where torch._grouped_mm cannot run (the CPU, fp32, older cards): a loop over experts,
# which reads the counts to the host. As a custom op of static shape it is one opaque node in a compiled
# block's graph (train.compile; the read would break the graph): (M, K) rows sorted by expert and (E, N, K)
# weights -> (M, N), the rows of group g (offs[g-1]:offs[g], offs the cumulative counts) times weight[g]^T.
# Its backward is two more ops, dx and dW, each the GEMM F.linear's own backward runs per expert. Eager and
# compiled blocks call the same ops, so a compiled step computes what an eager one does, bit for bit (a
# per-expert F.linear on a copy of its rows can differ in the last bit: the BLAS's kernel follows alignment).
def _groups(offs: torch.Tensor):
    """(g, rows) of each non-empty group g: rows = slice(offs[g-1], offs[g]), from one host read of offs."""
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            yield g, slice(start, end)
        start = end


@torch.library.custom_op("pipetrain::grouped_linear", mutates_args=())
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    out = x.new_zeros(x.shape[0], weight.shape[1])
    for g, rows in _groups(offs):
        out[rows] = F.linear(x[rows], weight[g])
    return out


@grouped_linear.register_fake
def _(x, weight, offs):
    return x.new_empty(x.shape[0], weight.shape[1])


@torch.library.custom_op("pipetrain::grouped_linear_weight_grad", mutates_args=())
def grouped_linear_weight_grad(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, num_groups: int) -> torch.Tensor:
    """(E, N, K): dy_g^T x_g per group (zero for an empty one), grouped_linear's weight gradient."""
    out = dy.new_zeros(num_groups, dy.shape[1], x.shape[1])
    for g, rows in _groups(offs):
        out[g] = x[rows].t().mm(dy[rows]).t()  # as F.linear's backward: (x^T dy)^T
    return out


@grouped_linear_weight_grad.register_fake
def _(dy, x, offs, num_groups):
    return dy.new_empty(num_groups, dy.shape[1], x.shape[1])


@torch.library.custom_op("pipetrain::grouped_linear_input_grad", mutates_args=())
def grouped_linear_input_grad(dy: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """(M, K): dy_g weight[g] per group, grouped_linear's input gradient."""
    out = dy.new_zeros(dy.shape[0], weight.shape[2])
    for g, rows in _groups(offs):
        out[rows] = dy[rows].mm(weight[g])
    return out


@grouped_linear_input_grad.register_fake
def _(dy, weight, offs):
    return dy.new_empty(dy.shape[0], weight.shape[2])


def _grouped_linear_setup(ctx, inputs, output):
    x, weight, offs = inputs
    ctx.save_for_backward(x, weight, offs)


def _grouped_linear_backward(ctx, dy):
    x, weight, offs = ctx.saved_tensors
    dx = grouped_linear_input_grad(dy, weight, offs) if ctx.needs_input_grad[0] else None
    dw = grouped_linear_weight_grad(dy, x, offs, weight.shape[0]) if ctx.needs_input_grad[1] else None
    return dx, dw, None


grouped_linear.register_autograd(_grouped_linear_backward, setup_context=_grouped_linear_setup)


class Experts(nn.Module):
    """E SwiGLU experts as stacked weights, nn.Linear's (out, in) convention per expert:
    gate/up (E, F, D), down (E, D, F). Tensor parallelism shards F (dim 1 of gate/up, dim 2 of down)."""

    def __init__(self, num_experts: int, d_model: int, ffn: int):
        super().__init__()
        self.gate = nn.Parameter(torch.empty(num_experts, ffn, d_model))
        self.up = nn.Parameter(torch.empty(num_experts, ffn, d_model))
        self.down = nn.Parameter(torch.empty(num_experts, d_model, ffn))
        self.fp8_grouped = None  # the float8 grouped GEMM under train.precision=fp8 (grouped_swiglu)


def _in_backward() -> bool:
    """True while autograd runs a backward pass: a full-recompute forward then runs again, and its
    routing must not be counted a second time (the original forward counted it)."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """The mixture-of-experts MLP of one block: x (B, T, D) -> (B, T, D)."""

    def __init__(self, cfg: ModelConfig, shared: nn.Module | None = None):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk
        self.aux_coef, self.bias_rate = cfg.router_aux_loss_coef, cfg.router_bias_update_rate
        self.router = Router(cfg.d_model, cfg.num_experts)
        self.experts = Experts(cfg.num_experts, cfg.d_model, cfg.expert_ffn)
        self.shared = shared
        # sequences in the global batch: the aux term's gradient is 1 / aux_sequences per sequence, as the
        # LM loss's is 1 / target tokens per token. None (a plain forward): this input's B.
        self.aux_sequences: int | None = None
        # set by tensor parallelism (pipetrain.parallel.tensor.layers.ExpertRegion): enter(x, w) -> (x, w)
        # in the tp region before the F-sharded experts, leave(y) sums their partial outputs over tp (under
        # sequence parallelism x is this rank's T/tp slice: enter gathers it, leave reduce-scatters y back,
        # and the router's logits arrive gathered, so route / account always see the whole sequence)
        self.expert_region = None
        # set by context parallelism (pipetrain.parallel.context): this rank holds 1/parts of each sequence's
        # tokens and sum(t) sums t over the ranks holding the others (module docstring, balance loss)
        self.token_split = None

    def route(self, x: torch.Tensor):
        """x (B, T, D) -> topk_idx (B*T, k), topk_w (B*T, k), stats (probs fp32 (B, T, E), idx). topk_w is in
        x's dtype, but at least fp32 under autocast, where x (the norm's output) is bf16 while the residual
        stream is fp32: the k weighted expert outputs of a token are then summed in fp32, as they were when
        the norm returned fp32 (a precision matter: CUDA's index_add_ sums in any order either way)."""
        logits = self.router(x)  # (B, T, E)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        bias = self.router.expert_bias if self.bias_rate > 0 else None
        topk_idx, topk_w = route_topk(probs.reshape(-1, self.num_experts), self.top_k, self.norm_topk, bias)
        dtype = torch.promote_types(x.dtype, torch.float32) if autocast_dtype(x) else x.dtype
        return topk_idx, topk_w.to(dtype), (probs, topk_idx)

    def dispatch_compute_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor):
        """Local dropless experts: (B, T, D) -> (B, T, D), sum_k w_k * expert_{idx_k}(x) per token."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, D)
        flat = topk_idx.reshape(-1)  # (N*k,)
        order = torch.argsort(flat, stable=True)  # rows grouped by expert, token order kept inside a group
        # rows per expert: not torch.bincount, which reads the largest index to the host on CUDA (a sync)
        counts = flat.new_zeros(self.num_experts).scatter_add_(0, flat, torch.ones_like(flat))
        token = order // self.top_k
        e = self.experts
        y = grouped_swiglu(x[token], counts, e.gate, e.up, e.down, e.fp8_grouped)  # (N*k, D) in expert order
        y = y * topk_w.reshape(-1)[order].unsqueeze(-1)
        out = x.new_zeros(x.shape, dtype=y.dtype).index_add_(0, token, y)  # y * w: fp32 under autocast (route)
        return out.view(shape)

    def account(self, y: torch.Tensor, stats) -> torch.Tensor:
        """Per-sequence balance (injected into backward when router_aux_loss_coef > 0) and the step's counts."""
        probs, topk_idx = stats
        B, T, E = probs.shape
        idx = topk_idx.reshape(B, T * self.top_k)
        counts = torch.zeros(B, E, device=probs.device, dtype=torch.float32)
        counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float32))  # (B, E) per sequence
        if self.token_split is None:
            f = counts * (E / (self.top_k * T))
            balance = (f * probs.mean(1)).sum(-1)  # (B,): 1 when balanced
        else:  # this rank's share of each whole sequence's balance (module docstring)
            whole = T * self.token_split.parts
            f = self.token_split.sum(counts.clone()) * (E / (self.top_k * whole))
            balance = (f * (probs.sum(1) / whole)).sum(-1)
        if self.training and torch.is_grad_enabled() and self.aux_coef > 0:
            scale = self.aux_coef / (self.aux_sequences or B)
            y = AuxLossInjector.apply(y, balance.sum(), scale)
        # compiled: the graph's forward applies its buffer mutations once; a recompute inside the backward
        # graph replays none of them
        if self.training and (torch.compiler.is_compiling() or not _in_backward()):
            self.router.step_counts += counts.sum(0).to(torch.float64)
            self.router.step_aux += balance.detach().sum().to(torch.float64)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_idx, topk_w, stats = self.route(x)
        xe, we = (x, topk_w) if self.expert_region is None else self.expert_region.enter(x, topk_w)
        y = self.dispatch_compute_combine(xe, topk_idx, we)
        if self.expert_region is not None:
            y = self.expert_region.leave(y)
        y = self.account(y, stats)
        return y if self.shared is None else y + self.shared(x)


def moe_layers(model: nn.Module) -> dict[int, MoE]:
    """{global layer index: MoE} of the layers this (possibly pruned) model holds."""
    return {int(i): block.mlp for i, block in model.layers.items() if isinstance(block.mlp, MoE)}


def set_aux_sequences(model: nn.Module, sequences: int) -> None:
    """Every MoE layer scales its aux gradient by 1 / sequences (the global batch: train.global_batch)."""
    for moe in moe_layers(model).values():
        moe.aux_sequences = sequences


@torch.no_grad()
def moe_step_end(model: nn.Module, reduce_fn: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    """After the optimizer step: the step's counts of every layer (rows of an (n_layers, E + 1) fp64
    table, this model's layers filled, the last column their balance sum) reduced by reduce_fn in place
    (the trainer's: a sum over dp and over pp, so every rank sees every layer; tp ranks hold the same
    counts and count once); moves the aux-free bias of the local layers (bias += rate * sign(mean count
    - count)) and resets the counts. Returns the metrics ({} for a dense model): "expert_load_max" and
    "expert_load_mean", lists over layers of the tokens per expert's max / mean, and "aux_loss",
    router_aux_loss_coef * sum over layers of the mean balance over the global batch's sequences."""
    cfg: ModelConfig = model.cfg
    if not cfg.is_moe:
        return {}
    layers, E = moe_layers(model), cfg.num_experts
    device = next(iter(layers.values())).router.weight.device if layers else torch.device("cpu")
    table = torch.zeros(cfg.n_layers, E + 1, dtype=torch.float64, device=device)
    for i, moe in layers.items():
        table[i, :E] = moe.router.step_counts
        table[i, E] = moe.router.step_aux
    reduce_fn(table)
    for i, moe in layers.items():
        counts = table[i, :E]
        if moe.bias_rate > 0:
            moe.router.expert_bias += moe.bias_rate * torch.sign(counts.mean() - counts).float()
        moe.router.step_counts.zero_()
        moe.router.step_aux.zero_()
    out = {"expert_load_max": table[:, :E].max(1).values.tolist(), "expert_load_mean": table[:, :E].mean(1).tolist()}
    if cfg.router_aux_loss_coef > 0:
        sequences = next((m.aux_sequences for m in layers.values() if m.aux_sequences), None)
        if sequences:
            out["aux_loss"] = cfg.router_aux_loss_coef * float(table[:, E].sum()) / sequences
    return out


__all__ = ["MoE", "Experts", "Router", "AuxLossInjector", "grouped_swiglu", "grouped_swiglu_loop", "route_topk",
           "moe_layers", "moe_step_end", "set_aux_sequences"]
