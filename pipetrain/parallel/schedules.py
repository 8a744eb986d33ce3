"""Pipeline schedules as pure data: per-rank action lists, and a validator that proves them.

A schedule is, for each pp rank, the ordered list of Actions that rank performs in one optimizer step:
compute (F, B, W) and point-to-point communication (SEND_*/RECV_*), nothing else. The executor
(run_schedule) walks the list and knows nothing of any particular schedule; this module never touches
torch.distributed. The timing simulator, ASCII/PNG timelines and the CLI live in schedule_sim.py.

Stages (Megatron convention): with p pp ranks and v model chunks per rank, chunk c on rank r is global
stage s = c*p + r. Stage s sends activations to s+1 and gradients to s-1, so rank r always sends
activations to rank (r+1) % p and gradients to rank (r-1) % p. Stage 0 has no RECV_ACT; the last stage
(p*v - 1) has no SEND_ACT, computes the loss in its F, and its B starts from that loss.

Action fields: `microbatch` and `chunk` name the local (microbatch, chunk) the data belongs to: for RECV_ACT
the chunk whose F consumes it, for SEND_ACT the chunk whose F produced it, likewise for gradients.
`peer` is the pp rank on the other end of a communication (None for F/B/W).

Split backward (zero-bubble pipelining, Qi et al. 2023): with split_backward=True every B computes only
what the previous stage waits for (the input gradient, sent at once) and a later W action of the same
(microbatch, chunk) computes the weight gradients (pipetrain.models.linear). W needs nothing from another
rank, so _place_weight_grads puts each W where its rank would otherwise wait for a message, in B order
(so every weight accumulates its gradients in microbatch order, as without the split), and never lets
a rank hold more microbatches (forwarded, weight gradients not yet done) than the unsplit schedule's
busiest rank does. For 1F1B this is ZB-H1: with the backward's input part I and weight part W each as
long as F (B = I + W = 2F), the idle time per rank drops from (p-1)(F+B) = 3(p-1)F to (p-1)(F+I-W) =
(p-1)F, a third, at the same peak activation memory (rank 0's; later ranks may now hold that many too).
It never makes a schedule slower in the simulator (tests/unit/test_schedules.py sweeps it). A B without a W
is the usual one and does everything: so is every B of a schedule without W actions, and a first-stage
B whose W would follow it with only first-stage Bs between (_merge_first_stage_weight_grads).

Execution semantics (validate_schedule proves a schedule deadlock-free under each by simulating all ranks):
- "async": SEND_* posts a non-blocking send (the executor completes it by the end of the step);
  RECV_* blocks until the data arrives. Whether or not the executor batches consecutive communication
  actions does not matter: batching only posts sends earlier.
- "rendezvous": stricter, NCCL's behaviour for large messages: a send completes only once the peer has
  posted the matching receive. The executor must post each maximal run of consecutive communication
  actions together (one batch_isend_irecv, or isend/irecv for all then wait) and the rank blocks until
  every op of the batch is matched. Issuing blocking sends one by one is not covered; it deadlocks 1F1B's
  steady state, which is why Megatron-LM pairs send_forward with recv_backward.
Messages on each directed rank pair are received in the order they are sent (NCCL matches p2p ops by
order, not by tag); validate_schedule checks exactly that.

How communication is placed (_place_comms): a builder fixes each rank's compute order, then runs it once
with reference costs (F=1, B=backward_cost, default 2; free transfers), every compute starting as soon as
its rank is free and its input exists. A send goes right after the compute that produces it; a receive goes right before the
first compute of the receiving rank that starts no earlier than the message was produced. Under async
timing with those costs no receive ever delays a compute, so the simulated bubble is the compute order's
own (GPipe and 1F1B keep it at any cost ratio; interleaved 1F1B loses some when the real ratio differs). Under rendezvous no deadlock is possible, for any compute costs: time each batch by the reference
start of the compute after it (the last compute's end for a final batch). If rank A is stuck at batch X
waiting for rank B to reach batch Y while B is stuck at an earlier batch Z, then time(Z) < time(X): if X
sends, Y is B's first batch timed at or after the production, which ends before time(X), so Z is timed
earlier; if X receives, Z precedes the producing compute, which ends no later than time(X). A waits-for
cycle would need time to decrease all the way round, so there is none.
"""
from __future__ import annotations

import bisect
import difflib
import warnings
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

F, B, W = "F", "B", "W"
SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD"
COMPUTE_KINDS = (F, B, W)
COMM_KINDS = (SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD)
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
SEMANTICS = ("async", "rendezvous")


@dataclass(frozen=True)
class Action:
    """One step of one rank: compute (F/B/W) or a point-to-point transfer with `peer`."""
    kind: str          # F, B, W, SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD
    microbatch: int
    chunk: int = 0     # model chunk (virtual stage) on this rank; 0 unless interleaved
    peer: int | None = None  # pp rank on the other end of a SEND_*/RECV_*; None for compute

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE_KINDS + COMM_KINDS:
            raise ValueError(f"Action.kind: unknown kind {self.kind!r}; use one of {COMPUTE_KINDS + COMM_KINDS}")

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    def __str__(self) -> str:
        where = f"mb {self.microbatch}" + (f" chunk {self.chunk}" if self.chunk else "")
        if self.peer is None:
            return f"{self.kind}({where})"
        return f"{self.kind}({where}) {'->' if self.kind.startswith('SEND') else '<-'} {self.peer}"


def stage_of(pp_rank: int, chunk: int, pp_size: int) -> int:
    """Global stage of `chunk` on `pp_rank` (Megatron's interleaved numbering)."""
    return chunk * pp_size + pp_rank


# Each message is identified by (payload, microbatch, src_stage, dst_stage), the same on both ends.
def _message(a: Action, pp_rank: int, pp_size: int) -> tuple[str, int, int, int]:
    s = stage_of(pp_rank, a.chunk, pp_size)
    return {SEND_ACT: ("act", a.microbatch, s, s + 1), RECV_ACT: ("act", a.microbatch, s - 1, s),
            SEND_GRAD: ("grad", a.microbatch, s, s - 1), RECV_GRAD: ("grad", a.microbatch, s + 1, s)}[a.kind]


def _expected_peer(kind: str, pp_rank: int, pp_size: int) -> int:
    return (pp_rank + 1) % pp_size if kind in (SEND_ACT, RECV_GRAD) else (pp_rank - 1) % pp_size


# ----------------------------------------------------------------------------------------------------------
# Builders: compute orders for every rank (placing a receive needs the sender's timing), then
# _place_comms. The per-rank functions return one rank's list.

Compute = tuple[str, int, int]  # (F, B or W, microbatch, chunk)


def _check_args(pp_rank: int, pp_size: int, num_microbatches: int, virtual_stages: int = 1) -> None:
    if pp_size < 1:
        raise ValueError(f"schedule: pp_size must be >= 1, got {pp_size}")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"schedule: pp_rank must be in [0, {pp_size}), got {pp_rank}")
    if num_microbatches < 1:
        raise ValueError(f"schedule: num_microbatches must be >= 1, got {num_microbatches}")
    if virtual_stages < 1:
        raise ValueError(f"schedule: virtual_stages must be >= 1, got {virtual_stages}")


def _gpipe_order(num_microbatches: int) -> list[Compute]:
    return [(F, i, 0) for i in range(num_microbatches)] + [(B, i, 0) for i in range(num_microbatches)]


def _one_f_one_b_order(pp_rank: int, pp_size: int, num_microbatches: int) -> list[Compute]:
    # Warmup fills the pipe below this rank; each later F is followed by the oldest pending B, so at most
    # num_warmup + 1 = pp_size - pp_rank microbatches hold activations here at once.
    num_warmup = min(pp_size - pp_rank - 1, num_microbatches)
    order = [(F, i, 0) for i in range(num_warmup)]
    for k in range(num_microbatches - num_warmup):
        order += [(F, num_warmup + k, 0), (B, k, 0)]
    return order + [(B, k, 0) for k in range(num_microbatches - num_warmup, num_microbatches)]


def _interleaved_order(pp_rank: int, pp_size: int, num_microbatches: int, virtual_stages: int) -> list[Compute]:
    p, v = pp_size, virtual_stages
    total = num_microbatches * v

    # Virtual microbatch k runs chunk ((k mod p*v) // p) on microbatch (k // (p*v))*p + k mod p: groups of p
    # microbatches go through chunk 0, then chunk 1, ..., then the next group. Backward visits chunks in
    # reverse. This is Narayanan et al. (2021) as implemented in Megatron-LM.
    def unit(k: int, kind: str) -> Compute:
        chunk = (k % (p * v)) // p
        return (kind, (k // (p * v)) * p + k % p, chunk if kind == F else v - 1 - chunk)

    # Warmup: (v-1)*p forwards bring the first group of microbatches to the last chunk; 2 more per rank
    # below this one cover the round trip (activation down, gradient back) before its first backward.
    num_warmup = min(2 * (p - pp_rank - 1) + (v - 1) * p, total)
    order = [unit(k, F) for k in range(num_warmup)]
    for k in range(total - num_warmup):
        order += [unit(num_warmup + k, F), unit(k, B)]
    return order + [unit(k, B) for k in range(total - num_warmup, total)]


def _source(p: int, last: int, r: int, kind: str, mb: int, c: int) -> tuple[int, Compute] | None:
    """(rank, compute) whose output this compute on rank r consumes; None for the first F, the last B and W."""
    s = stage_of(r, c, p)
    if kind == F and s > 0:
        return (s - 1) % p, (F, mb, (s - 1) // p)
    if kind == B and s < last:
        return (s + 1) % p, (B, mb, (s + 1) // p)
    return None


def _in_flight_bound(order: Sequence[Compute]) -> int:
    live = peak = 0
    for kind, _, _ in order:
        live += (kind == F) - (kind == B)
        peak = max(peak, live)
    return peak


def _place_weight_grads(orders: list[list[Compute]], virtual_stages: int, cost: dict[str, float]) -> list[list[Compute]]:
    """Give every B of the compute orders a W (module docstring: split backward), placed by a reference run.

    Ranks advance in time order (always the one with the earliest clock that can do something). A rank
    whose next compute's input is not there yet does its oldest pending W instead of waiting; before an
    F that would hold more microbatches than the unsplit schedule's busiest rank does (rank 0's p in
    1F1B) it does one too; at its end it does the rest.
    """
    p = len(orders)
    last = p * virtual_stages - 1
    bound = max(_in_flight_bound(order) for order in orders)
    out: list[list[Compute]] = [[] for _ in range(p)]
    pending: list[list[Compute]] = [[] for _ in range(p)]
    idx, live, clock = [0] * p, [0] * p, [0.0] * p
    finished: dict[tuple[int, Compute], float] = {}

    def run(r: int, x: Compute) -> None:
        out[r].append(x)
        clock[r] += cost[x[0]]
        finished[(r, x)] = clock[r]
        live[r] += (x[0] == F) - (x[0] == W)

    while any(idx[r] < len(orders[r]) or pending[r] for r in range(p)):
        for r in sorted(range(p), key=lambda q: (clock[q], q)):
            if idx[r] == len(orders[r]):
                if not pending[r]:
                    continue
                run(r, pending[r].pop(0))
                break
            kind, mb, c = x = orders[r][idx[r]]
            src = _source(p, last, r, kind, mb, c)
            ready = clock[r] if src is None else finished.get(src)
            # Earliest-clock rank: an input not produced yet can only arrive after clock[r].
            if pending[r] and (ready is None or ready > clock[r] or (kind == F and live[r] + 1 > bound)):
                run(r, pending[r].pop(0))
                break
            if ready is None:
                continue  # blocked with nothing to fill in: let another rank move
            clock[r] = max(clock[r], ready)
            run(r, x)
            idx[r] += 1
            if kind == B:
                pending[r].append((W, mb, c))
            break
        else:
            raise AssertionError("_place_weight_grads: compute orders deadlock")
    return out


def _place_comms(orders: list[list[Compute]], virtual_stages: int, cost: dict[str, float]) -> list[list[Action]]:
    """Add SEND/RECV actions to every rank's compute order (the rule and its proof: module docstring)."""
    p = len(orders)
    last = p * virtual_stages - 1

    def source(r: int, kind: str, mb: int, c: int) -> tuple[int, Compute] | None:
        return _source(p, last, r, kind, mb, c)

    # Reference run: every compute starts as soon as its rank is free and its input has been produced.
    # A B without a W of its own does the whole backward (cost of B and W).
    split = [{(mb, c) for kind, mb, c in order if kind == W} for order in orders]

    def duration(r: int, kind: str, mb: int, c: int) -> float:
        return cost[kind] + (cost.get(W, 0.0) if kind == B and (mb, c) not in split[r] else 0.0)

    starts: list[list[float]] = [[] for _ in range(p)]
    finished: dict[tuple[int, Compute], float] = {}
    clock = [0.0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while len(starts[r]) < len(orders[r]):
                x = orders[r][len(starts[r])]
                src = source(r, *x)
                if src is not None and src not in finished:
                    break
                start = max(clock[r], finished[src]) if src is not None else clock[r]
                starts[r].append(start)
                clock[r] = finished[(r, x)] = start + duration(r, *x)
                progress = True
    assert all(len(starts[r]) == len(orders[r]) for r in range(p)), "_place_comms: compute orders deadlock"

    # Each receive goes right before the first compute of the receiver that starts no earlier than the
    # message was produced; receives there are ordered by production time, so every directed rank pair
    # receives in the order it sends.
    recvs: list[list[list[tuple[float, Action]]]] = [[[] for _ in order] for order in orders]
    for q, order in enumerate(orders):
        for kind, mb, c in order:
            src = source(q, kind, mb, c)
            if src is not None:
                made = finished[src]
                j = bisect.bisect_left(starts[q], made)  # starts are non-decreasing on a rank
                recvs[q][j].append((made, Action(RECV_ACT if kind == F else RECV_GRAD, mb, c, peer=src[0])))
    out: list[list[Action]] = []
    for r, order in enumerate(orders):
        actions: list[Action] = []
        for k, (kind, mb, c) in enumerate(order):
            actions += [a for _, a in sorted(recvs[r][k], key=lambda ta: ta[0])]
            actions.append(Action(kind, mb, c))
            s = stage_of(r, c, p)
            if kind == F and s < last:
                actions.append(Action(SEND_ACT, mb, c, peer=(r + 1) % p))
            elif kind == B and s > 0:
                actions.append(Action(SEND_GRAD, mb, c, peer=(r - 1) % p))
        out.append(actions)
    return out


def build_all_schedules(name: str, pp_size: int, num_microbatches: int, virtual_stages: int = 1, *,
                        backward_cost: float = 2.0, split_backward: bool = False) -> list[list[Action]]:
    """Every rank's action list for schedule `name`: one call instead of pp_size (validator, simulator).

    backward_cost is B's time relative to F's, used only to place receives and W actions (module
    docstring): about 2 normally, 3 with full activation recomputation; with split_backward half of it
    is taken as B's input-gradient part and half as W. Any positive value gives a deadlock-free schedule.
    """
    _check_args(0, pp_size, num_microbatches, virtual_stages)
    if not backward_cost > 0:
        raise ValueError(f"schedule: backward_cost must be > 0, got {backward_cost}")
    p, m, v = pp_size, num_microbatches, virtual_stages
    if name not in SCHEDULES:
        close = difflib.get_close_matches(name, SCHEDULES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"schedule: unknown schedule {name!r}, expected one of {', '.join(SCHEDULES)}{hint}")
    if v != 1 and name != "interleaved-1f1b":
        raise ValueError(f"schedule: virtual_stages={v} needs schedule interleaved-1f1b, got {name!r}; "
                         f"set virtual_stages=1 or use interleaved-1f1b")
    if name == "gpipe":
        return _finish([_gpipe_order(m)] * p, 1, backward_cost, split_backward)
    if v == 1:  # 1f1b, and interleaved-1f1b with one chunk per rank, which is the same thing
        if m < p:
            warnings.warn(f"1f1b: num_microbatches={m} < pp_size={p}; the pipeline never reaches steady state "
                          f"and idles {(p - 1) / (m + p - 1):.0%} of the step; use num_microbatches >= pp_size "
                          f"(4*pp_size or more keeps the bubble small)")
        return _finish([_one_f_one_b_order(r, p, m) for r in range(p)], 1, backward_cost, split_backward)
    if p == 1:
        raise ValueError(f"interleaved-1f1b: virtual_stages={v} needs pp_size >= 2, got 1; one rank has no "
                         f"bubble to shrink, so use schedule 1f1b (or virtual_stages=1)")
    if m % p:
        raise ValueError(f"interleaved-1f1b: num_microbatches={m} must be a multiple of pp_size={p} "
                         f"(microbatches pass through the chunks in groups of pp_size); use {m + p - m % p}")
    return _finish([_interleaved_order(r, p, m, v) for r in range(p)], v, backward_cost, split_backward)


def _finish(orders: list[list[Compute]], virtual_stages: int, backward_cost: float,
            split_backward: bool) -> list[list[Action]]:
    if not split_backward:
        return _place_comms(orders, virtual_stages, {F: 1.0, B: backward_cost})
    cost = {F: 1.0, B: backward_cost / 2, W: backward_cost / 2}
    orders = _place_weight_grads(orders, virtual_stages, cost)
    return _place_comms([_merge_first_stage_weight_grads(order, r) for r, order in enumerate(orders)],
                        virtual_stages, cost)


def _merge_first_stage_weight_grads(order: list[Compute], pp_rank: int) -> list[Compute]:
    """Fold a first-stage W back into its B where only first-stage Bs lie between them.

    Splitting pays by sending the input gradient before the weight gradients are done; the first stage
    sends none. Moving its W up to its B delays only first-stage Bs, which nobody waits for, and never
    delays the rank's end (a W needs no input, so doing it earlier can only fill a wait), while the
    split costs time (operands kept and re-read, a Python autograd Function per linear layer:
    benchmarks/pipeline.py). That is every W of rank 0 in 1F1B (each directly after its B) and in
    GPipe (all after the last B). A W with an earlier, unmerged W between it and its B stays split,
    so weight gradients still add up in microbatch order.
    """
    if pp_rank != 0:  # stage 0 is chunk 0 of rank 0
        return order
    out = list(order)
    for x in [x for x in order if x[0] == W and x[2] == 0]:
        i, j = out.index((B, x[1], 0)), out.index(x)
        if all(kind == B and c == 0 for kind, _, c in out[i + 1:j]):
            del out[j]
    return out


def gpipe(pp_rank: int, pp_size: int, num_microbatches: int) -> list[Action]:
    """GPipe: all forwards, then all backwards; holds all m microbatches in flight. Proven: async, rendezvous."""
    _check_args(pp_rank, pp_size, num_microbatches)
    return build_all_schedules("gpipe", pp_size, num_microbatches)[pp_rank]


def one_f_one_b(pp_rank: int, pp_size: int, num_microbatches: int) -> list[Action]:
    """1F1B (PipeDream-Flush): min(p - r - 1, m) warmup forwards, then alternate F and B, then drain the Bs.

    Holds at most p - pp_rank microbatches in flight. num_microbatches < pp_size is allowed (the schedule is
    still correct and deadlock-free; it degenerates towards GPipe with the same bubble) but warns, since
    the bubble (p-1)/(m+p-1) is then at least half the step. Proven: async, rendezvous.
    """
    _check_args(pp_rank, pp_size, num_microbatches)
    return build_all_schedules("1f1b", pp_size, num_microbatches)[pp_rank]


def interleaved_one_f_one_b(pp_rank: int, pp_size: int, num_microbatches: int, virtual_stages: int, *,
                            backward_cost: float = 2.0) -> list[Action]:
    """Interleaved 1F1B: v model chunks per rank shrink the bubble to about (p-1)/(v*m + p-1).

    Needs num_microbatches % pp_size == 0 (microbatches move through the chunks in groups of pp_size) and
    pp_size >= 2 when virtual_stages >= 2; virtual_stages == 1 is plain 1F1B. Holds at most
    min(2*(p - r - 1) + (v-1)*p + 1, m*v) (microbatch, chunk) units in flight, each 1/v of a rank's layers.
    Unlike GPipe and 1F1B its bubble depends on backward_cost matching the real B/F ratio (see
    build_all_schedules). Proven: async, rendezvous.
    """
    _check_args(pp_rank, pp_size, num_microbatches, virtual_stages)
    return build_all_schedules("interleaved-1f1b", pp_size, num_microbatches, virtual_stages,
                               backward_cost=backward_cost)[pp_rank]


def build_schedule(name: str, pp_rank: int, pp_size: int, num_microbatches: int, virtual_stages: int = 1, *,
                   backward_cost: float = 2.0, split_backward: bool = False) -> list[Action]:
    """Action list of `pp_rank` for schedule `name` (one of SCHEDULES); keywords: build_all_schedules."""
    _check_args(pp_rank, pp_size, num_microbatches, virtual_stages)
    return build_all_schedules(name, pp_size, num_microbatches, virtual_stages, backward_cost=backward_cost,
                               split_backward=split_backward)[pp_rank]


# ----------------------------------------------------------------------------------------------------------
# Validation.

def _fail(pp_rank: int, index: int, action: Action | None, problem: str) -> ValueError:
    where = f"rank {pp_rank}, action {index}" + (f" {action}" if action is not None else "")
    return ValueError(f"schedule: {where}: {problem}")


def _check_rank(actions: Sequence[Action], pp_rank: int, pp_size: int, num_microbatches: int,
                virtual_stages: int) -> None:
    """Ranges, peers, exactly-once, and local order (inputs arrive before use, outputs leave after)."""
    last = pp_size * virtual_stages - 1
    seen: dict[tuple[str, int, int], int] = {}
    for i, a in enumerate(actions):
        if not 0 <= a.microbatch < num_microbatches:
            raise _fail(pp_rank, i, a, f"microbatch out of range [0, {num_microbatches})")
        if not 0 <= a.chunk < virtual_stages:
            raise _fail(pp_rank, i, a, f"chunk out of range [0, {virtual_stages})")
        s = stage_of(pp_rank, a.chunk, pp_size)
        if a.is_comm:
            if a.peer != _expected_peer(a.kind, pp_rank, pp_size):
                raise _fail(pp_rank, i, a, f"peer must be rank {_expected_peer(a.kind, pp_rank, pp_size)}")
            if a.kind in (RECV_ACT, SEND_GRAD) and s == 0:
                raise _fail(pp_rank, i, a, "the first stage has no previous stage to talk to")
            if a.kind in (SEND_ACT, RECV_GRAD) and s == last:
                raise _fail(pp_rank, i, a, "the last stage has no next stage to talk to")
        elif a.peer is not None:
            raise _fail(pp_rank, i, a, "compute actions have no peer")
        key = (a.kind, a.microbatch, a.chunk)
        if key in seen:
            raise _fail(pp_rank, i, a, f"duplicate of action {seen[key]}")
        seen[key] = i
        # What must already have happened on this rank before `a` can run.
        needs = {F: [(RECV_ACT, "its input activation (RECV_ACT)")] if s > 0 else [],
                 B: [(F, "its forward")] + ([(RECV_GRAD, "its output gradient (RECV_GRAD)")] if s < last else []),
                 SEND_ACT: [(F, "the forward that produces it")],
                 SEND_GRAD: [(B, "the backward that produces it")], W: [(B, "its backward")],
                 RECV_ACT: [], RECV_GRAD: []}[a.kind]
        for kind, what in needs:
            if (kind, a.microbatch, a.chunk) not in seen:
                raise _fail(pp_rank, i, a, f"comes before {what}")
    for mb in range(num_microbatches):
        for c in range(virtual_stages):
            s = stage_of(pp_rank, c, pp_size)
            required = [F, B] + ([RECV_ACT, SEND_GRAD] if s > 0 else []) + ([SEND_ACT, RECV_GRAD] if s < last else [])
            for kind in required:
                if (kind, mb, c) not in seen:
                    raise _fail(pp_rank, len(actions), None, f"missing {Action(kind, mb, c)} (stage {s})")


def _pair_messages(schedules: Sequence[Sequence[Action]],
                   pp_size: int) -> dict[tuple[int, int], tuple[int, int]]:
    """Match the k-th send on each directed rank pair with the k-th receive; {(rank, index): (peer, index)}."""
    sends: dict[tuple[int, int], list[int]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[int]] = defaultdict(list)
    for r, actions in enumerate(schedules):
        for i, a in enumerate(actions):
            if a.kind in (SEND_ACT, SEND_GRAD):
                sends[(r, a.peer)].append(i)
            elif a.kind in (RECV_ACT, RECV_GRAD):
                recvs[(a.peer, r)].append(i)
    match: dict[tuple[int, int], tuple[int, int]] = {}
    for src, dst in sorted(set(sends) | set(recvs)):
        out, inc = sends[(src, dst)], recvs[(src, dst)]
        for k in range(max(len(out), len(inc))):
            if k >= len(inc):
                raise _fail(src, out[k], schedules[src][out[k]], f"send #{k} to rank {dst} has no matching receive")
            if k >= len(out):
                raise _fail(dst, inc[k], schedules[dst][inc[k]], f"receive #{k} from rank {src} has no matching send")
            sa, ra = schedules[src][out[k]], schedules[dst][inc[k]]
            if _message(sa, src, pp_size) != _message(ra, dst, pp_size):
                raise _fail(dst, inc[k], ra, f"receive #{k} from rank {src} is paired by order with {sa} "
                                             f"(rank {src}, action {out[k]}); sends and receives disagree in order")
            match[(src, out[k])] = (dst, inc[k])
            match[(dst, inc[k])] = (src, out[k])
    return match


def find_deadlock(schedules: Sequence[Sequence[Action]], match: dict[tuple[int, int], tuple[int, int]],
                  semantics: str) -> str | None:
    """Execute every rank's list under `semantics`; None if all finish, else who is stuck where."""
    p = len(schedules)
    # A step is a run of consecutive comm actions (a batch) or one compute action.
    steps: list[list[list[int]]] = []
    for actions in schedules:
        rank_steps: list[list[int]] = []
        for i, a in enumerate(actions):
            if semantics == "rendezvous" and a.is_comm and rank_steps and actions[rank_steps[-1][-1]].is_comm:
                rank_steps[-1].append(i)
            else:
                rank_steps.append([i])
        steps.append(rank_steps)
    pos = [0] * p
    posted: set[tuple[int, int]] = set()  # (rank, index) of comm ops a rank has reached

    def done(r: int, i: int) -> bool:
        a = schedules[r][i]
        if semantics == "async":
            return a.kind not in (RECV_ACT, RECV_GRAD) or match[(r, i)] in posted
        return not a.is_comm or match[(r, i)] in posted

    progress = True
    while progress:  # sweep the ranks until none can move; finishing order does not matter
        progress = False
        for r in range(p):
            while pos[r] < len(steps[r]):
                step = steps[r][pos[r]]
                if (r, step[0]) not in posted:
                    posted.update((r, i) for i in step)
                    progress = True
                if not all(done(r, i) for i in step):
                    break
                pos[r] += 1
                progress = True
    if all(pos[r] == len(steps[r]) for r in range(p)):
        return None
    stuck = []
    for r in range(p):
        if pos[r] < len(steps[r]):
            i = next(i for i in steps[r][pos[r]] if not done(r, i))
            peer, j = match[(r, i)]
            stuck.append(f"rank {r} at action {i} {schedules[r][i]} waits for rank {peer} "
                         f"to reach action {j} {schedules[peer][j]}")
    return f"deadlock under {semantics} semantics: " + "; ".join(stuck)


def peak_in_flight(actions: Sequence[Action]) -> int:
    """Most (microbatch, chunk) units forwarded but not yet backwarded (or, with a W, weight-gradiented) at
    any point: live activations."""
    split = {(a.microbatch, a.chunk) for a in actions if a.kind == W}
    live = peak = 0
    for a in actions:
        done = a.kind == W or (a.kind == B and (a.microbatch, a.chunk) not in split)
        live += (a.kind == F) - done
        peak = max(peak, live)
    return peak


def validate_schedule(schedules: Sequence[Sequence[Action]], pp_size: int, num_microbatches: int,
                      virtual_stages: int = 1, *, semantics: Sequence[str] = SEMANTICS,
                      max_in_flight: Sequence[int] | None = None) -> None:
    """Raise ValueError (naming rank, action index and problem) unless `schedules` is a correct schedule.

    Checks: every (microbatch, stage) F and B exactly once, F before B, at most one W and after its B; receives precede the compute that
    needs them and sends follow the compute that produces them; sends and receives pair up in the same
    order on every directed rank pair; every rank finishes under each of `semantics` (simulated); and,
    when given, no rank holds more than max_in_flight[rank] activations (see peak_in_flight).
    """
    if len(schedules) != pp_size:
        raise ValueError(f"schedule: expected one action list per pp rank ({pp_size}), got {len(schedules)}")
    if virtual_stages > 1 and pp_size == 1:
        raise ValueError("schedule: virtual_stages > 1 needs pp_size >= 2; stages on one rank would send to itself")
    for r, actions in enumerate(schedules):
        _check_rank(actions, r, pp_size, num_microbatches, virtual_stages)
    match = _pair_messages(schedules, pp_size)
    for sem in semantics:
        if sem not in SEMANTICS:
            raise ValueError(f"schedule: unknown semantics {sem!r}, expected one of {SEMANTICS}")
        problem = find_deadlock(schedules, match, sem)
        if problem:
            raise ValueError(f"schedule: {problem}")
    if max_in_flight is not None:
        peaks = [peak_in_flight(a) for a in schedules]
        for r, (peak, bound) in enumerate(zip(peaks, max_in_flight)):
            if peak > bound:
                raise ValueError(f"schedule: rank {r} holds {peak} microbatches in flight, above its bound "
                                 f"{bound}; peaks per rank: {peaks}")


if __name__ == "__main__":
    from pipetrain.parallel.schedule_sim import main
    raise SystemExit(main())
