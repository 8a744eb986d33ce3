"""Every collective and point-to-point transfer; those of tensor and sequence parallelism as autograd
Functions (Megatron's f and g).

Each Function is the conjugate of another: the forward of one is the backward of the other, so a
tensor-parallel region is entered and left with matching communication in both directions.

    copy_to_tp           forward: identity                  backward: all-reduce over tp      (f)
    reduce_from_tp       forward: all-reduce over tp        backward: identity                (g)
    gather_sequence      forward: all-gather along T        backward: reduce-scatter along T
    reduce_scatter_sequence  forward: reduce-scatter along T  backward: all-gather along T
    gather_sequence_replicated  forward: all-gather along T   backward: this rank's slice along T
    gather_over_cp       forward: all-gather K/V along T      backward: reduce-scatter along T (over cp)
    all_to_all_tokens    forward: all-to-all, uneven splits   backward: the reverse all-to-all (over ep)

Shapes: B batch, T time (dim 1 of activations), D model; under sequence parallelism a rank holds
(B, T/tp, D). A group of None means a group of one: every operator is then the identity and no
collective is issued (None never means the default world group here).

Every torch.distributed collective and point-to-point transfer of pipetrain goes through this module:
the blocking primitives (all_reduce_, all_reduce_max_, all_gather, reduce_scatter, all_to_all_single), their async
variants for overlapping with compute (all_reduce_async, all_gather_async, reduce_scatter_async: ZeRO's
buckets) and post_p2p (the pipeline executor's sends and receives). reduce_scatter probes the backend
at first use: older gloo builds lack reduce_scatter, and then it falls back to all_reduce + slice
(same result, n times the received bytes). The probe result is cached per (backend, dtype) in
_NATIVE_REDUCE_SCATTER, the module's only mutable state; it is a fact about the installed backend, not
run configuration.

Every tensor handed to a collective must sit on the device its group's backend takes (check_devices):
a gloo group CPU tensors, an nccl group CUDA tensors on this rank's current device. A tensor built
without `device=` lands on the default device, which is the CPU: right for gloo, a crash inside NCCL on
a GPU run. The check raises CommDeviceError at the call instead, on any machine, so the CPU tests catch
such a tensor when they run with a default device that is not the mesh's (tests/harness.py).
group_device(pg) is the device to build a tensor on that a collective over pg will receive.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

ProcessGroup = Optional[dist.ProcessGroup]

# (backend name, dtype) -> whether the backend's reduce_scatter works; filled at first use.
_NATIVE_REDUCE_SCATTER: dict[tuple[str, torch.dtype], bool] = {}


def _all_gather_into(out, x, group, async_op=False):
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single; older releases have only the former.
    return getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, x, group=group, async_op=async_op)


def _reduce_scatter_into(out, x, group, async_op=False):
    return getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, x, op=dist.ReduceOp.SUM,
                                                                              group=group, async_op=async_op)


def _fresh(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy that a collective may overwrite in place (autograd inputs must not change)."""
    return x.clone(memory_format=torch.contiguous_format)


class CommDeviceError(RuntimeError):
    """A tensor reached a collective on a device its group's backend does not take (an internal bug)."""


# backend name -> the device type its tensors must have; other backends (mpi, ucc, fake) are not checked
_BACKEND_DEVICE = {"gloo": "cpu", "nccl": "cuda"}


def _device_types(pg) -> set[str] | None:
    """Device types pg's backend takes ('cpu:gloo,cuda:nccl' style groups take both); None: unchecked.
    Looked up per call rather than cached: a cache keyed by group would outlive destroyed groups (a
    ProcessGroup takes no weak reference), and the lookup is a dict read next to a collective."""
    backend = str(dist.get_backend(pg))
    if ":" in backend:
        return {part.split(":")[0] for part in backend.split(",")}
    found = _BACKEND_DEVICE.get(backend)
    return None if found is None else {found}


def group_device(pg: ProcessGroup) -> torch.device:
    """The device a tensor must be on to go through a collective over pg: CUDA (this rank's current
    device) for nccl, else the CPU (gloo, or a group of one, where nothing moves)."""
    types = _device_types(pg) if group_size(pg) > 1 else None
    if types == {"cuda"}:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_devices(call: str, pg, *tensors: torch.Tensor) -> None:
    """Raise CommDeviceError unless every tensor sits on a device pg's backend takes (pg None: the default
    group; comm's primitives call this only when a collective is really issued)."""
    types = _device_types(pg)
    if types is None:
        return
    for t in tensors:
        ok = t.device.type in types
        if ok and t.device.type == "cuda" and types == {"cuda"}:
            ok = t.device.index == torch.cuda.current_device()  # nccl binds one device per rank
        if not ok:
            want = " or ".join(sorted(types))
            if types == {"cuda"} and torch.cuda.is_available():
                want = f"cuda:{torch.cuda.current_device()}"
            raise CommDeviceError(
                f"comm.{call}: a {tuple(t.shape)} {t.dtype} tensor on {t.device} reached a "
                f"{dist.get_backend(pg)} group, which takes {want} tensors; create it with "
                f"device=comm.group_device(pg)")


def group_size(pg: ProcessGroup) -> int:
    """Ranks in pg; 1 for None."""
    return 1 if pg is None else dist.get_world_size(pg)


def group_rank(pg: ProcessGroup) -> int:
    """This process's rank within pg; 0 for None."""
    return 0 if pg is None else dist.get_rank(pg)


class _Done:
    """The Work of a collective over a group of one: nothing to wait for."""

    def wait(self) -> bool:
        return True


class _ThenCopy:
    """A Work whose wait() also copies src into dst once the collective finished (the reduce-scatter fallback)."""

    def __init__(self, work, dst: torch.Tensor, src: torch.Tensor):
        self.work, self.dst, self.src = work, dst, src

    def wait(self) -> bool:
        self.work.wait()
        self.dst.copy_(self.src)
        return True


# ---- primitives: the only callers of torch.distributed collectives ----

def all_reduce_(x: torch.Tensor, pg: ProcessGroup) -> torch.Tensor:
    """Sum x over pg in place and return it (inside a compiled block: a new tensor, see _all_reduce)."""
    return _all_reduce(x, pg, "sum", "all_reduce_")


def all_reduce_max_(x: torch.Tensor, pg: ProcessGroup) -> torch.Tensor:
    """Elementwise maximum of x over pg, in place; returns x (inside a compiled block: a new tensor)."""
    return _all_reduce(x, pg, "max", "all_reduce_max_")


def _all_reduce(x: torch.Tensor, pg: ProcessGroup, op: str, call: str) -> torch.Tensor:
    """Inside a compiled block (train.compile) the functional all-reduce, out of place, as all_gather's: torch
    2.11 lost the gradient through dynamo's own rewrite of the in-place call (docs/compile.md)."""
    if group_size(pg) > 1:
        check_devices(call, pg, x)
        if torch.compiler.is_compiling():
            return funcol.all_reduce(x, op, pg)
        dist.all_reduce(x, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=pg)
    return x


def all_gather(x: torch.Tensor, dim: int, pg: ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's x along dim, in rank order (every rank's x has the same shape)."""
    n = group_size(pg)
    if n == 1:
        return x
    check_devices("all_gather", pg, x)
    moved = x.movedim(dim, 0).contiguous()  # collectives concatenate along dim 0
    if torch.compiler.is_compiling():  # inside a compiled block (train.compile): the traceable functional form
        return funcol.all_gather_tensor(moved, 0, pg).movedim(0, dim).contiguous()
    out = torch.empty((n * moved.shape[0],) + tuple(moved.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_into(out, moved, group=pg)
    return out.movedim(0, dim).contiguous()


def _start_native_reduce_scatter(out: torch.Tensor, x: torch.Tensor, pg: ProcessGroup, async_op: bool,
                                 native: bool | None):
    """Start the backend's reduce_scatter of x (dim 0) into out: its Work (or _Done when blocking), or
    None when the backend lacks it or native=False (then the caller falls back to all_reduce + slice)."""
    key = (str(dist.get_backend(pg)), x.dtype)
    if native is None:
        native = _NATIVE_REDUCE_SCATTER.get(key, True)
    if not native:
        return None
    try:
        work = _reduce_scatter_into(out, x, group=pg, async_op=async_op)
    except (RuntimeError, NotImplementedError):
        # The backend rejects the op locally before any data moves, identically on every rank of
        # the group (same backend, same dtype), so all of them take the fallback together.
        if key in _NATIVE_REDUCE_SCATTER:
            raise
        _NATIVE_REDUCE_SCATTER[key] = False
        return None
    _NATIVE_REDUCE_SCATTER[key] = True
    return work if async_op else _Done()


def reduce_scatter(x: torch.Tensor, dim: int, pg: ProcessGroup, native: bool | None = None) -> torch.Tensor:
    """Sum x over pg and keep this rank's chunk of x.shape[dim] / n along dim.

    native=None uses the backend's reduce_scatter when the first-use probe found it working, else
    all_reduce + slice; True/False force one path (tests compare them).
    """
    n = group_size(pg)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"reduce_scatter: dim {dim} of shape {tuple(x.shape)} is not divisible by the "
                         f"group size {n}; make the sequence length a multiple of tp")
    check_devices("reduce_scatter", pg, x)
    moved = x.movedim(dim, 0).contiguous()
    if torch.compiler.is_compiling() and native is not False and \
            _NATIVE_REDUCE_SCATTER.get((str(dist.get_backend(pg)), x.dtype), True):
        # inside a compiled block (train.compile): the functional form. The probe's first-use cache write
        # cannot be traced, so a compiled graph only reads what an eager call found (none: native).
        return funcol.reduce_scatter_tensor(moved, "sum", 0, pg).movedim(0, dim).contiguous()
    out = torch.empty((moved.shape[0] // n,) + tuple(moved.shape[1:]), dtype=x.dtype, device=x.device)
    if _start_native_reduce_scatter(out, moved, pg, async_op=False, native=native) is not None:
        return out.movedim(0, dim).contiguous()
    # Fallback: the full sum on every rank, then this rank's slice.
    summed = all_reduce_(_fresh(x), pg)
    chunk = x.shape[dim] // n
    return summed.narrow(dim, group_rank(pg) * chunk, chunk).contiguous()


def all_to_all_single(x: torch.Tensor, out_splits: list[int], in_splits: list[int], pg: ProcessGroup) -> torch.Tensor:
    """Rows of x (dim 0) exchanged over pg: in_splits[r] consecutive rows go to rank r, out_splits[r] rows
    arrive from rank r, in rank order: (sum(in_splits), ...) -> (sum(out_splits), ...). Splits may be
    uneven and zero (expert parallelism's token dispatch)."""
    if group_size(pg) == 1:
        return x
    check_devices("all_to_all_single", pg, x)
    x = x.contiguous()
    out = torch.empty((sum(out_splits),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x, output_split_sizes=list(out_splits), input_split_sizes=list(in_splits), group=pg)
    return out


# ---- async primitives: start a collective, wait() on the returned Work before reading the result ----

def all_reduce_async(x: torch.Tensor, pg: ProcessGroup):
    """Start summing x over pg in place."""
    if group_size(pg) == 1:
        return _Done()
    check_devices("all_reduce_async", pg, x)
    return dist.all_reduce(x, op=dist.ReduceOp.SUM, group=pg, async_op=True)


def all_gather_async(out: torch.Tensor, x: torch.Tensor, pg: ProcessGroup):
    """Start gathering every rank's flat x into out (n * x.numel(),), in rank order."""
    if group_size(pg) == 1:
        out.copy_(x)
        return _Done()
    check_devices("all_gather_async", pg, out, x)
    return _all_gather_into(out, x, group=pg, async_op=True)


def reduce_scatter_async(out: torch.Tensor, flat: torch.Tensor, pg: ProcessGroup):
    """Start summing flat (n * P,) over pg into out (P,), this rank's part. flat is scratch: the
    fallback for backends without reduce_scatter all-reduces it in place and copies the part at wait()."""
    n = group_size(pg)
    if n == 1:
        out.copy_(flat)
        return _Done()
    check_devices("reduce_scatter_async", pg, out, flat)
    work = _start_native_reduce_scatter(out, flat, pg, async_op=True, native=None)
    if work is not None:
        return work
    part = out.numel()
    me = group_rank(pg)
    return _ThenCopy(all_reduce_async(flat, pg), out, flat[me * part:(me + 1) * part].view_as(out))


# ---- point-to-point (the pipeline executor) ----

# -- tagged point-to-point on a group (the parameter servers' protocol: pipetrain.parallel.ps). Ranks
# are global; recv_any_ takes a message from whichever member sent first and returns its rank.
def isend(x: torch.Tensor, dst: int, pg: ProcessGroup, tag: int = 0):
    check_devices("isend", pg, x)
    return dist.isend(x, dst, group=pg, tag=tag)


def irecv(x: torch.Tensor, src: int, pg: ProcessGroup, tag: int = 0):
    check_devices("irecv", pg, x)
    return dist.irecv(x, src, group=pg, tag=tag)


def send_(x: torch.Tensor, dst: int, pg: ProcessGroup, tag: int = 0) -> None:
    check_devices("send_", pg, x)
    dist.send(x, dst, group=pg, tag=tag)


def recv_(x: torch.Tensor, src: int, pg: ProcessGroup, tag: int = 0) -> torch.Tensor:
    check_devices("recv_", pg, x)
    dist.recv(x, src, group=pg, tag=tag)
    return x


def recv_any_(x: torch.Tensor, pg: ProcessGroup, tag: int = 0) -> int:
    """Receive into x from any member of pg; returns the sender's global rank."""
    check_devices("recv_any_", pg, x)
    return dist.recv(x, group=pg, tag=tag)


def broadcast_(x: torch.Tensor, src: int, pg: ProcessGroup) -> torch.Tensor:
    """x from global rank src on every member of pg, in place (a group of one: x unchanged)."""
    if group_size(pg) > 1:
        check_devices("broadcast_", pg, x)
        dist.broadcast(x, src, group=pg)
    return x


def batches_p2p_by_default() -> bool:
    """Whether the default backend's sends and receives can be posted as one batch_isend_irecv: not on
    gloo, where a send completes only once the peer posts its receive, so they are posted one by one."""
    return not (dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() == "gloo")


def post_p2p(ops: list[tuple[bool, torch.Tensor, int]], batched: bool) -> list[list]:
    """Post sends (True, tensor, peer global rank) and receives (False, buffer, peer) in order; returns,
    per op, the Works to wait for before its buffer is read (batched: the batch's, which NCCL may
    coalesce into one)."""
    check_devices("post_p2p", None, *(t for _, t, _ in ops))
    if batched:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend if send else dist.irecv, t, peer)
                                        for send, t, peer in ops])
        return [works] * len(ops)
    return [[(dist.isend if send else dist.irecv)(t, peer)] for send, t, peer in ops]


# ---- autograd Functions ----

class _CopyToTP(torch.autograd.Function):
    """forward: identity; backward: all-reduce over tp (each rank holds a partial input gradient)."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return all_reduce_(_fresh(dy), ctx.pg), None


class _ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce over tp (sum of partial outputs); backward: identity (the gradient of a sum
    is replicated)."""

    @staticmethod
    def forward(ctx, x, pg):
        return all_reduce_(_fresh(x), pg)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _AlongSequence(torch.autograd.Function):
    """One collective along T in forward, its conjugate in backward (forward_op, backward_op: all_gather and
    reduce_scatter, either way round):
    - all-gather (B, T/tp, D) -> (B, T, D); backward reduce-scatter (the gathered tensor feeds
      column-parallel layers, so each rank holds a partial gradient of all of T);
    - reduce-scatter (B, T, D) partial sums -> (B, T/tp, D); backward all-gather (the gradient of this
      rank's slice of a sum is that slice of the replicated gradient)."""

    @staticmethod
    def forward(ctx, x, pg, forward_op, backward_op):
        ctx.pg, ctx.backward_op = pg, backward_op
        return forward_op(x, 1, pg)

    @staticmethod
    def backward(ctx, dy):
        return ctx.backward_op(dy, 1, ctx.pg), None, None, None


class _AllToAll(torch.autograd.Function):
    """forward: rows of x to their ranks (in_splits out, out_splits in); backward: the reverse all-to-all
    (each row's gradient goes back to the rank that sent the row)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, pg):
        ctx.splits, ctx.pg = (out_splits, in_splits), pg
        return all_to_all_single(x, out_splits, in_splits, pg)

    @staticmethod
    def backward(ctx, dy):
        out_splits, in_splits = ctx.splits
        return all_to_all_single(dy, in_splits, out_splits, ctx.pg), None, None, None


def all_to_all_tokens(x: torch.Tensor, out_splits: list[int], in_splits: list[int], pg: ProcessGroup) -> torch.Tensor:
    """forward: all-to-all of x's rows over pg (in_splits[r] rows to rank r, out_splits[r] from it);
    backward: the reverse all-to-all."""
    return x if group_size(pg) == 1 else _AllToAll.apply(x, list(out_splits), list(in_splits), pg)


def copy_to_tp(x: torch.Tensor, tp_group: ProcessGroup) -> torch.Tensor:
    """f: forward identity, backward all-reduce over tp."""
    return x if group_size(tp_group) == 1 else _CopyToTP.apply(x, tp_group)


def reduce_from_tp(x: torch.Tensor, tp_group: ProcessGroup) -> torch.Tensor:
    """g: forward all-reduce over tp, backward identity."""
    return x if group_size(tp_group) == 1 else _ReduceFromTP.apply(x, tp_group)


def gather_sequence(x: torch.Tensor, tp_group: ProcessGroup) -> torch.Tensor:
    """forward: all-gather along T, (B, T/tp, D) -> (B, T, D); backward: reduce-scatter along T."""
    return x if group_size(tp_group) == 1 else _AlongSequence.apply(x, tp_group, all_gather, reduce_scatter)


def gather_over_cp(x: torch.Tensor, cp_group: ProcessGroup) -> torch.Tensor:
    """forward: all-gather along T over cp, (B, T/cp, H, K) -> (B, T, H, K) in cp rank order; backward:
    reduce-scatter along T (every rank's queries give a partial gradient of every key and value). The same
    collective pair as sequence parallelism's gather, over the cp group."""
    return gather_sequence(x, cp_group)


def _own_slice(x: torch.Tensor, dim: int, pg: ProcessGroup) -> torch.Tensor:
    """This rank's 1/n of x along dim (no communication)."""
    chunk = x.shape[dim] // group_size(pg)
    return x.narrow(dim, group_rank(pg) * chunk, chunk).contiguous()


def gather_sequence_replicated(x: torch.Tensor, tp_group: ProcessGroup) -> torch.Tensor:
    """forward: all-gather along T, (B, T/tp, E) -> (B, T, E); backward: this rank's T/tp slice of the
    gradient, not summed. For a gathered tensor that feeds replicated computation only (a MoE router's
    logits under sequence parallelism): every rank then holds the whole, identical gradient of all of T."""
    return x if group_size(tp_group) == 1 else _AlongSequence.apply(x, tp_group, all_gather, _own_slice)


def reduce_scatter_sequence(x: torch.Tensor, tp_group: ProcessGroup) -> torch.Tensor:
    """forward: reduce-scatter along T, (B, T, D) -> (B, T/tp, D); backward: all-gather along T."""
    return x if group_size(tp_group) == 1 else _AlongSequence.apply(x, tp_group, reduce_scatter, all_gather)


# -- trainer-level reductions
# Whole-world collectives of the training loop and of building a run: every rank of the mesh (the
# default group, or with parameter servers the workers' group, which set_workers_group installs; the
# servers, pipetrain.parallel.ps, never join these). With one process they return their input and
# issue nothing.
_WORKERS: ProcessGroup = None  # None: the default group


def set_workers_group(pg: ProcessGroup) -> None:
    """The group the whole-world collectives below use (ParallelDims sets it when servers exist)."""
    global _WORKERS
    _WORKERS = pg


def sum_over_world_(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """Sum x over every worker rank, in place; returns x."""
    if world_size > 1:
        check_devices("sum_over_world_", _WORKERS, x)
        dist.all_reduce(x, group=_WORKERS)
    return x


def max_over_world_async(x: torch.Tensor, world_size: int):
    """Start an elementwise maximum of x over every worker rank, in place; wait() on the result before
    reading x."""
    if world_size == 1:
        return _Done()
    check_devices("max_over_world_async", _WORKERS, x)
    return dist.all_reduce(x, op=dist.ReduceOp.MAX, async_op=True, group=_WORKERS)


def broadcast_object_from_rank0(obj, world_size: int):
    """Rank 0's obj (picklable) on every process, servers included (world_size: all of them)."""
    if world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(world_size: int) -> None:
    """Wait until every worker rank reaches this point."""
    if world_size > 1:
        dist.barrier(group=_WORKERS)


# -- every process, parameter servers included (the checkpoint's agreement: pipetrain.checkpoint; the
# launch's plan: pipetrain.plan.auto)
def process_count() -> int:
    """Processes of the default group, servers included; 1 before torch.distributed is initialised."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_gather_object(obj, full_world_size: int, pg: ProcessGroup = None) -> list:
    """Every process's obj (picklable), in rank order; pg None: the default group (servers included).
    Objects travel as tensors torch builds on the group's device itself, so no device check is needed."""
    if full_world_size == 1:
        return [obj]
    out = [None] * full_world_size
    dist.all_gather_object(out, obj, group=pg)
    return out
