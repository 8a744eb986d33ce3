"""The Triton kernels as custom ops under torch.compile (train.compile): traced whole (fullgraph) into one
graph as pipetrain::<op> nodes, with fake implementations and registered backwards that match the
references forward and backward.

On CPU the kernels run in the Triton interpreter, whose kernels wrap_triton cannot trace into (AOT autograd
would launch them on fake tensors), so these tests compile with the `eager` backend: dynamo traces the
function with the ops' fake implementations and the graph then runs the real ops and their autograd
formulas. On a GPU inductor traces through the same ops into their Triton kernels.
"""
import pytest
import torch

from pipetrain.kernels import register_compile_ops, rms_norm, rope, swiglu
from pipetrain.kernels.compile_ops import backward_op, declared, forward_op
from pipetrain.kernels.rms_norm import rms_norm_ref
from pipetrain.kernels.rope import rope_ref
from pipetrain.kernels.swiglu import swiglu_ref
from tests.kernels.common import FP32, fresh_seed, randn

KERNELS = ("rms_norm", "rope", "swiglu")  # every kernel the model calls that has a Triton path

# fake tensors, the schema and the autograd registration; the AOT checks need kernels wrap_triton can trace
OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


def _block(norm, rot, act, x, w, q, k, cos, sin, gate, up):
    """A block-shaped use of all three ops; returns one scalar whose gradient reaches every input."""
    qo, ko = rot(q, k, cos, sin)
    return (norm(x, w, 1e-6) * 1.5).sum() + (qo * qo).sum() + (ko * 0.5).sum() + act(gate, up).square().sum()


def _inputs(seed: int):
    shapes = [(2, 5, 40), (40,), (2, 5, 4, 8), (2, 5, 2, 8), (5, 8), (5, 8), (3, 7, 6), (3, 7, 6)]
    tensors = [randn(seed + i, *s) for i, s in enumerate(shapes)]
    for i in (0, 1, 2, 3, 6, 7):  # not the position tables: rope has no gradient for them
        tensors[i].requires_grad_()
    return tensors


def _value_and_grads(fn, tensors):
    out = fn(*tensors)
    grads = torch.autograd.grad(out, [t for t in tensors if t.requires_grad])
    return [out.detach(), *grads]


def test_every_kernel_declares_its_compile_op():
    assert declared() == sorted(KERNELS)


@pytest.mark.triton
def test_compiled_block_of_custom_ops_matches_reference_forward_and_backward(force_triton):
    register_compile_ops()  # before any trace, as apply_compile does in a run
    seed = fresh_seed()
    graphs = []

    def recording(gm, example_inputs):  # the eager backend, keeping the graph dynamo traced
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda *t: _block(rms_norm, rope, swiglu, *t), backend=recording, fullgraph=True)
    got = _value_and_grads(compiled, _inputs(seed))
    want = _value_and_grads(lambda *t: _block(rms_norm_ref, rope_ref, swiglu_ref, *t), _inputs(seed))
    for name, a, b in zip(("loss", "dx", "dw", "dq", "dk", "dgate", "dup"), got, want):
        torch.testing.assert_close(a, b, **FP32, msg=lambda m: f"seed={seed} {name}: {m}")
    assert len(graphs) == 1, "fullgraph: one graph"
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert {"pipetrain.rms_norm.default", "pipetrain.rope.default", "pipetrain.swiglu.default"} <= targets, targets


@pytest.mark.triton
def test_custom_ops_pass_opcheck(force_triton):
    register_compile_ops()
    seed = fresh_seed()
    x, w, q, k, cos, sin, gate, up = _inputs(seed)
    dy = randn(seed + 9, *x.shape)
    rstd = forward_op("rms_norm")(x, w, 1e-6, x.dtype)[1]
    cases = [("rms_norm", (x, w, 1e-6, x.dtype), (dy, x.detach(), w.detach(), rstd)),
             # out in autocast's bf16 from the fp32 residual stream, and its bf16 gradient back
             ("rms_norm", (x, w, 1e-6, torch.bfloat16), (dy.bfloat16(), x.detach(), w.detach(), rstd)),
             ("rope", (q, k, cos, sin), (q.detach(), k.detach(), cos, sin)),
             ("swiglu", (gate, up), (gate.detach(), gate.detach(), up.detach()))]
    cases = [(op, args) for name, fwd, bwd in cases for op, args in ((forward_op(name), fwd), (backward_op(name), bwd))]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=OPCHECKS)
