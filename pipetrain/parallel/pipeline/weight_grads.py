"""How linear and embedding weight gradients are produced: accumulated in place, or deferred.

A backward through y = x W^T + b computes two things: the input gradient dx = dy W, which the layers
before (and the previous pipeline stage) wait for, and the weight gradients dW = dy^T x and db = sum(dy),
which nobody needs until the optimizer step. Plain autograd computes dW into a new tensor and then adds
it to .grad: for each of a step's microbatches after the first, one more pass over every weight's
gradient (the head's V x D matrix included). The plain model (pipetrain.models) uses nn.Linear and
nn.Embedding; apply_grad_accumulation_fusion(model, min_numel) turns the modules named in GRAD_PLAN into
WeightGradModules, in place, whose two modes are state of each module:

- `fuse` (set by apply_grad_accumulation_fusion from the explicit threshold): gradient accumulation
  fusion (Megatron-LM's name), for linear weights of at least min_numel elements (the recipe's
  train.grad_accumulation_fusion_min_numel; below that the Python Function costs more than the pass
  it saves) and for every embedding. The backward computes dx and adds dW straight into .grad with one
  GEMM (addmm_, beta = 1), b's into its .grad; an embedding adds the rows of dy into .grad (index_add_).
  It returns no gradient for W and b, so their AccumulateGrad nodes run with nothing to add and fire
  the post-accumulate-grad hooks (ZeRO-2's overlapped reduction) once per backward, after every use of
  the weight has been added (a tied weight too). The sum is the same; rounding differs from plain
  autograd (add-into-GEMM against GEMM-then-add) at fp32 round-off, and every layout accumulates the
  same microbatches in the same order, so layouts still agree with each other bit for bit.
- `deferred` (a WeightGradWork list, set by the pipeline executor with `deferring(modules, work)` around
  the F and B of a (microbatch, chunk) that has a W action): the split backward of zero-bubble
  pipelining. The layer has no graph edge to its weight or bias: the backward computes only dx and
  appends (weight, bias, x, dy) to the list; `apply_weight_grads(work)` later does the same in-place
  accumulation and fires the hooks, when the executor reaches the W action. Only the time moves
  (tests/unit/test_linear.py). Embeddings ignore it: their backward is a scatter, done in B. Inside a
  block compiled by train.compile, two custom ops do the same (see _compiled_linear below).

Both modes are read at forward time and bound into the autograd node, so a backward needs no module
state (CUDA runs backwards on other threads); activation recomputation re-runs the forward inside B,
which is why the executor defers around B too. Otherwise `linear` is plain F.linear; so is a weight
that is not a leaf parameter (a slice of one, as ReplicatedKVLinear uses), and, when deferring, an
input that needs no gradient. The tensor-parallel modules (pipetrain.parallel.tensor.layers) are
WeightGradModules from the start.

Mixed precision: under torch.autocast the matmuls run in the autocast dtype, as autocast runs F.linear
(operands cast down, gradients cast back to the parameters' dtype: added with add_, since addmm_ cannot
mix dtypes); x is saved in the cast dtype, so the saved bytes equal plain autocast's.

Shapes: x (..., D_in) flattened to (N, D_in), dy (N, D_out), W (D_out, D_in); embedding ids (N,), rows (N, D).
"""
from __future__ import annotations

import contextlib
import re
import weakref
from typing import Iterable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipetrain.models.decoder import PositionEmbedding

WeightGradWork = list  # of (weight, bias | None, x (N, D_in), dy (N, D_out)): one entry per linear call


def add_to_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """param.grad += grad in place (or param.grad = grad), cast to the parameter's dtype."""
    if param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad.add_(grad)


def _add_matmul_to_grad(param: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """param.grad += a @ b: one GEMM that reads and writes .grad (beta = 1) when the dtypes agree."""
    if param.grad is not None and a.dtype == param.grad.dtype:
        param.grad.addmm_(a, b)
    else:
        add_to_grad(param, a.mm(b))


def _accumulate(weight, bias, x2: torch.Tensor, dy2: torch.Tensor) -> None:
    """Under no_grad (a backward runs so)."""
    _add_matmul_to_grad(weight, dy2.t(), x2)  # dW = dy^T x, as autograd's mm backward computes it
    if bias is not None:
        add_to_grad(bias, dy2.sum(0))


class _RunHooks(torch.autograd.Function):
    """A graph whose backward runs the leaves' AccumulateGrad nodes with no gradient: nothing is added,
    their post-accumulate-grad hooks fire (tests/unit/test_linear.py checks both)."""

    @staticmethod
    def forward(ctx, *leaves):
        return torch.zeros((), device=leaves[0].device)

    @staticmethod
    def backward(ctx, _):
        return (None,) * len(ctx.needs_input_grad)


def run_grad_hooks(leaves) -> None:
    """Fire the post-accumulate-grad hooks of leaves whose .grad was updated in place, outside a backward."""
    leaves = [p for p in leaves if p is not None and p.requires_grad]
    if leaves:
        with torch.enable_grad():
            _RunHooks.apply(*leaves).backward()


def apply_weight_grads(work: WeightGradWork) -> None:
    """Add the recorded weight gradients into .grad in place, fire their hooks, then empty `work`."""
    leaves = []
    with torch.no_grad():
        for weight, bias, x2, dy2 in work:
            _accumulate(weight, bias, x2, dy2)
            leaves += [weight, bias]
    work.clear()
    run_grad_hooks(leaves)


class _LinearFn(torch.autograd.Function):
    """y = x W^T + b whose backward returns only dx and either adds dW, db into .grad now (work None:
    W and b are the leaves themselves, so the graph reaches their AccumulateGrad nodes, which then fire
    the hooks) or records them in `work` (W and b arrive detached: no edge, nothing fires until W)."""

    @staticmethod
    def forward(ctx, x, weight, bias, leaves, work):
        device = x.device.type
        if torch.is_autocast_enabled(device):  # what autocast does to F.linear, done here so x is saved cast
            x = x.to(torch.get_autocast_dtype(device))
            with torch.autocast(device, enabled=False):
                out = F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
        else:
            out = F.linear(x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.leaves, ctx.work = leaves, work
        return out

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2, x2 = dy.reshape(-1, weight.shape[0]), x.reshape(-1, weight.shape[1])
        if dy2.dtype != x.dtype:
            dy2 = dy2.to(x.dtype)
        if ctx.work is None:
            _accumulate(*ctx.leaves, x2, dy2)
        else:
            ctx.work.append((*ctx.leaves, x2, dy2))
        dx = None
        if ctx.needs_input_grad[0]:
            dx = dy2.mm(weight if weight.dtype == x.dtype else weight.to(x.dtype)).view(*dy.shape[:-1], weight.shape[1])
        return dx, None, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, fuse: bool = False,
           work: WeightGradWork | None = None, fp8=None, work_key: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with the weight gradients accumulated in place (fuse) or deferred into work (module docstring).
    fp8: the module's pipetrain.parallel.tensor.fp8.Fp8Linear, which computes it instead (dW through autograd).
    work_key: the module's key for a split backward inside a compiled block (assign_work_keys)."""
    if fp8 is not None:
        return fp8(x, weight, bias)
    if torch.compiler.is_compiling():
        # Inside a compiled block (train.compile, pipetrain.models.compile) a backward that writes .grad or a
        # Python list cannot be traced: the block's backward graph computes dW, unless the executor may defer
        # this module (a split backward), where two opaque ops do what _LinearFn does (_compiled_linear).
        # `work` is never read here: a guard on it would recompile the block whenever deferring() sets it.
        if work_key is not None and x.requires_grad and _leaves_need_grad(weight, bias):
            return _compiled_linear(x, weight, bias, work_key)
        return F.linear(x, weight, bias)
    if (work is None and not fuse) or not torch.is_grad_enabled() or not _leaves_need_grad(weight, bias):
        return F.linear(x, weight, bias)
    if work is not None and x.requires_grad:
        return _LinearFn.apply(x, weight.detach(), None if bias is None else bias.detach(), (weight, bias), work)
    if fuse:
        return _LinearFn.apply(x, weight, bias, (weight, bias), None)
    return F.linear(x, weight, bias)


def _leaves_need_grad(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return weight.requires_grad and weight.is_leaf and (bias is None or (bias.requires_grad and bias.is_leaf))


# ---- the split backward inside a compiled block ----
# Under train.compile with a split backward (zbv, parallel.split_backward) a deferrable linear inside a
# compiled block is the custom op pipetrain::deferrable_linear (y = x W^T + b), whose autograd formula is a
# second op, pipetrain::linear_dx_weight_work: it returns dx = dy W and, like _LinearFn's backward, records
# (W, b, x, dy) in the module's `deferred` list when the executor is deferring it, or adds dW, db into .grad
# at once (apply_weight_grads) when not. Both are opaque to the graph (the second one's side effect is
# why: a traced backward cannot write a Python list); W, b enter them detached (no gradient flows back
# through them). Unlike eager, the compiled block's backward node still has an edge to every parameter of
# the block, so a deferred weight's post-accumulate-grad hook fires in B with nothing added, then again
# at W with dW (docs/compile.md says why ZeRO-2 still reduces after the last W). An op sees only tensors
# and numbers: the module comes from its work_key, a CPU int64 scalar naming it in
# _KEYED (a tensor, not an int, so that every block of a rank still shares one graph: dynamo specialises
# on ints). Module state on purpose: the op's implementation is global.
_KEYED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # work_key value -> WeightGradModule


def assign_work_keys(modules: Iterable["WeightGradModule"]) -> list["WeightGradModule"]:
    """Give each module a work_key (once) so a compiled block can defer its weight gradients; returns them."""
    modules = list(modules)
    for m in modules:
        if m.work_key is None:
            m.work_key = torch.tensor(id(m), dtype=torch.int64)
            _KEYED[id(m)] = m
    return modules


@torch.library.custom_op("pipetrain::deferrable_linear", mutates_args=())
def _deferrable_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          work_key: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight, bias)


@_deferrable_linear_op.register_fake
def _(x, weight, bias, work_key):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("pipetrain::linear_dx_weight_work", mutates_args=())
def _linear_dx_weight_work_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                              work_key: torch.Tensor) -> torch.Tensor:
    module = _KEYED[int(work_key)]
    dy2, x2 = dy.reshape(-1, weight.shape[0]), x.reshape(-1, weight.shape[1])
    if module.deferred is None:  # this microbatch has no W action: now, as fusion does
        apply_weight_grads([(module.weight, module.bias, x2, dy2)])
    else:
        # copies: inductor may reuse an input's buffer once the graph has no further use for it
        module.deferred.append((module.weight, module.bias, x2.clone(), dy2.clone()))
    return dy2.mm(weight).view(*dy.shape[:-1], weight.shape[1])


@_linear_dx_weight_work_op.register_fake
def _(dy, x, weight, work_key):
    return dy.new_empty(*dy.shape[:-1], weight.shape[1])


def _deferrable_linear_setup(ctx, inputs, output):
    x, weight, _, work_key = inputs
    ctx.save_for_backward(x, weight, work_key)


def _deferrable_linear_backward(ctx, dy):
    x, weight, work_key = ctx.saved_tensors
    return _linear_dx_weight_work_op(dy, x, weight, work_key), None, None, None


_deferrable_linear_op.register_autograd(_deferrable_linear_backward, setup_context=_deferrable_linear_setup)


def _compiled_linear(x, weight, bias, work_key):
    """The deferrable linear as traced: autocast's casts done here (custom ops get none), x saved cast."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, weight, bias = x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
    return _deferrable_linear_op(x, weight.detach(), None if bias is None else bias.detach(), work_key)


class _EmbeddingFn(torch.autograd.Function):
    """F.embedding whose backward adds the rows of dy into weight.grad (the first microbatch of a step
    allocates the zeroed gradient, as plain autograd does) and returns nothing for the weight."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        with torch.no_grad():
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight, memory_format=torch.contiguous_format)
            weight.grad.index_add_(0, ids.reshape(-1), dy.reshape(-1, weight.shape[1]).to(weight.dtype))
        return None, None


def embedding(ids: torch.Tensor, weight: torch.Tensor, fuse: bool = False) -> torch.Tensor:
    """F.embedding(ids, weight), with the gradient added into weight.grad in place when fuse."""
    if fuse and torch.is_grad_enabled() and weight.requires_grad and weight.is_leaf:
        return _EmbeddingFn.apply(ids, weight)
    return F.embedding(ids, weight)


class WeightGradModule:
    """Mixin of every module whose weight gradients can be fused or deferred; the defaults are plain
    autograd. Instances get their own values from apply_grad_accumulation_fusion and deferring."""

    fuse: bool = False
    deferred: WeightGradWork | None = None
    fp8 = None  # an Fp8Linear under train.precision=fp8 (pipetrain.parallel.tensor.fp8.apply_fp8)
    work_key: torch.Tensor | None = None  # set by assign_work_keys: deferrable inside a compiled block


class WeightGradLinear(WeightGradModule, nn.Linear):
    """nn.Linear (same parameters and state-dict names) whose weight gradients can be fused or deferred."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.fuse, self.deferred, self.fp8, self.work_key)


class WeightGradEmbedding(WeightGradModule, nn.Embedding):
    """nn.Embedding (same parameter and state-dict name) whose weight gradient can be fused; with
    padding_idx, max_norm or sparse gradients it stays plain F.embedding."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.padding_idx is not None or self.max_norm is not None or self.sparse:
            return super().forward(ids)
        return embedding(ids, self.weight, self.fuse)


class WeightGradPositionEmbedding(PositionEmbedding, WeightGradEmbedding):
    """gpt2's learned positions: PositionEmbedding's forward(T), its lookup WeightGradEmbedding's."""


# Module name (with any "layers.<i>." prefix removed) -> (the plain class it replaces, the replacement).
GRAD_PLAN: dict[str, tuple[type, type]] = {
    "embed": (nn.Embedding, WeightGradEmbedding),
    "pos_embed": (PositionEmbedding, WeightGradPositionEmbedding),
    **{name: (nn.Linear, WeightGradLinear) for name in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.gate",
                                                        "mlp.up", "mlp.down", "mlp.shared.gate", "mlp.shared.up",
                                                        "mlp.shared.down", "head")},
}
_EMBEDDINGS = ("embed", "pos_embed")  # fused at any size: their backward is a scatter, not a GEMM
_LAYER_PREFIX = re.compile(r"^layers\.\d+\.")


def apply_grad_accumulation_fusion(model: nn.Module, min_numel: int | None) -> None:
    """Make the model's linears and embeddings (GRAD_PLAN) WeightGradModules, in place, and fuse the
    gradient accumulation of every embedding and of the linears of at least min_numel weight elements
    (min_numel None: fuse none; the executor can still defer). Call after apply_tensor_parallel (its
    modules are WeightGradModules already and only get `fuse` here); before or after build_stage and
    materialize. Calling it again sets `fuse` anew."""
    for name, module in model.named_modules():
        key = _LAYER_PREFIX.sub("", name)
        if key not in GRAD_PLAN:
            continue
        plain, replacement = GRAD_PLAN[key]
        if type(module) is plain:
            # In place (as FSDP2's fully_shard does) rather than a new module: the chunk views of
            # build_stage and every other reference see it; parameters, names and hooks stay.
            module.__class__ = replacement
        if isinstance(module, WeightGradModule):
            module.fuse = min_numel is not None and (key in _EMBEDDINGS or module.weight.numel() >= min_numel)


def weight_grad_modules(module: nn.Module) -> list[WeightGradModule]:
    """The WeightGradModules in module (a pipeline chunk), for deferring()."""
    return [m for m in module.modules() if isinstance(m, WeightGradModule)]


@contextlib.contextmanager
def deferring(modules: Iterable[WeightGradModule], work: WeightGradWork) -> Iterator[WeightGradWork]:
    """Linear layers among modules run forward inside append their weight-gradient work to `work` at
    backward time; each module's previous list is restored afterwards."""
    modules = list(modules)
    outer = [m.deferred for m in modules]
    for m in modules:
        m.deferred = work
    try:
        yield work
    finally:
        for m, previous in zip(modules, outer):
            m.deferred = previous
