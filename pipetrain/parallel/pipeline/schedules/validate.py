"""validate_schedule: prove a set of action lists is a correct, deadlock-free pipeline schedule.

Execution semantics (validate_schedule proves a schedule deadlock-free under each by executing all ranks):
- "async": SEND_* posts a non-blocking send (the executor completes it by the end of the step);
  RECV_* blocks until the data arrives. Whether or not the executor batches consecutive communication
  actions does not matter: batching only posts sends earlier.
- "rendezvous": stricter, NCCL's behaviour for large messages: a send completes only once the peer has
  posted the matching receive. The executor must post each maximal run of consecutive communication
  actions together (one batch_isend_irecv, or isend/irecv for all then wait) and the rank blocks until
  every op of the batch is matched. Issuing blocking sends one by one is not covered; it deadlocks 1F1B's
  steady state, which is why Megatron-LM pairs send_forward with recv_backward.
Messages on each directed rank pair are received in the order they are sent (NCCL matches p2p ops by
order, not by tag); validate_schedule checks exactly that. This is a validator of structure, used by the
tests and the timeline; it raises ValueError naming rank, action index and problem.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from pipetrain.parallel.pipeline.schedules.actions import (B, F, PLACEMENTS, RECV_ACT, RECV_GRAD, SEMANTICS, SEND_ACT, SEND_GRAD,
                                                           W, Action, expected_peer, message, rank_chunk_of, stage_of)

def _fail(pp_rank: int, index: int, action: Action | None, problem: str) -> ValueError:
    where = f"rank {pp_rank}, action {index}" + (f" {action}" if action is not None else "")
    return ValueError(f"schedule: {where}: {problem}")


def _check_rank(actions: Sequence[Action], pp_rank: int, pp_size: int, num_microbatches: int,
                virtual_stages: int, placement: str = "loop") -> None:
    """Ranges, peers, exactly-once, and local order (inputs arrive before use, outputs leave after)."""
    last = pp_size * virtual_stages - 1

    def neighbour(s: int) -> tuple[int, int] | None:  # (rank, chunk) of stage s, None past either end
        return rank_chunk_of(s, pp_size, placement) if 0 <= s <= last else None

    def local(s: int) -> int | None:  # this rank's chunk holding stage s (the V's local edge), else None
        rc = neighbour(s)
        return rc[1] if rc is not None and rc[0] == pp_rank else None

    seen: dict[tuple[str, int, int], int] = {}
    for i, a in enumerate(actions):
        if not 0 <= a.microbatch < num_microbatches:
            raise _fail(pp_rank, i, a, f"microbatch out of range [0, {num_microbatches})")
        if not 0 <= a.chunk < virtual_stages:
            raise _fail(pp_rank, i, a, f"chunk out of range [0, {virtual_stages})")
        s = stage_of(pp_rank, a.chunk, pp_size, placement)
        prev, nxt = local(s - 1), local(s + 1)
        if a.is_comm:
            peer = expected_peer(a.kind, pp_rank, pp_size, a.chunk, placement)
            if a.peer != peer:
                raise _fail(pp_rank, i, a, f"peer must be rank {peer}")
            if a.kind in (RECV_ACT, SEND_GRAD) and s == 0:
                raise _fail(pp_rank, i, a, "the first stage has no previous stage to talk to")
            if a.kind in (SEND_ACT, RECV_GRAD) and s == last:
                raise _fail(pp_rank, i, a, "the last stage has no next stage to talk to")
            if (a.kind in (RECV_ACT, SEND_GRAD) and prev is not None) or (a.kind in (SEND_ACT, RECV_GRAD)
                                                                          and nxt is not None):
                raise _fail(pp_rank, i, a, "the neighbouring stage is on this rank: the hand-off is local, "
                                           "not a message")
        elif a.peer is not None:
            raise _fail(pp_rank, i, a, "compute actions have no peer")
        key = (a.kind, a.microbatch, a.chunk)
        if key in seen:
            raise _fail(pp_rank, i, a, f"duplicate of action {seen[key]}")
        seen[key] = i
        # What must already have happened on this rank before `a` can run.
        needs = {F: [] if s == 0 else [(RECV_ACT, "its input activation (RECV_ACT)")] if prev is None else
                 [(F, "the forward of the previous stage", prev)],
                 B: [(F, "its forward")] + ([] if s == last else [(RECV_GRAD, "its output gradient (RECV_GRAD)")]
                                            if nxt is None else [(B, "the backward of the next stage", nxt)]),
                 SEND_ACT: [(F, "the forward that produces it")],
                 SEND_GRAD: [(B, "the backward that produces it")], W: [(B, "its backward")],
                 RECV_ACT: [], RECV_GRAD: []}[a.kind]
        for kind, what, *chunk in needs:
            if (kind, a.microbatch, chunk[0] if chunk else a.chunk) not in seen:
                raise _fail(pp_rank, i, a, f"comes before {what}")
    for mb in range(num_microbatches):
        for c in range(virtual_stages):
            s = stage_of(pp_rank, c, pp_size, placement)
            required = ([F, B] + ([RECV_ACT, SEND_GRAD] if s > 0 and local(s - 1) is None else [])
                        + ([SEND_ACT, RECV_GRAD] if s < last and local(s + 1) is None else []))
            for kind in required:
                if (kind, mb, c) not in seen:
                    raise _fail(pp_rank, len(actions), None, f"missing {Action(kind, mb, c)} (stage {s})")


def pair_messages(schedules: Sequence[Sequence[Action]], pp_size: int,
                  placement: str = "loop") -> dict[tuple[int, int], tuple[int, int]]:
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
            if message(sa, src, pp_size, placement) != message(ra, dst, pp_size, placement):
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
                      max_in_flight: Sequence[int] | None = None, placement: str = "loop") -> None:
    """Raise ValueError (naming rank, action index and problem) unless `schedules` is a correct schedule.

    Checks: every (microbatch, stage) F and B exactly once, F before B, at most one W and after its B; receives precede the compute that
    needs them and sends follow the compute that produces them; sends and receives pair up in the same
    order on every directed rank pair; every rank finishes under each of `semantics` (simulated); and,
    when given, no rank holds more than max_in_flight[rank] activations (see peak_in_flight).
    placement "v" (actions.py) places the stages in a V: it needs two chunks per rank, and the hand-off
    between the chunks of rank p-1 must be local (no SEND/RECV for it).
    """
    if len(schedules) != pp_size:
        raise ValueError(f"schedule: expected one action list per pp rank ({pp_size}), got {len(schedules)}")
    if virtual_stages > 1 and pp_size == 1:
        raise ValueError("schedule: virtual_stages > 1 needs pp_size >= 2; stages on one rank would send to itself")
    if placement not in PLACEMENTS:
        raise ValueError(f"schedule: unknown placement {placement!r}, expected one of {PLACEMENTS}")
    if placement == "v" and virtual_stages != 2:
        raise ValueError(f"schedule: placement 'v' needs virtual_stages=2 (two chunks per rank), got {virtual_stages}")
    for r, actions in enumerate(schedules):
        _check_rank(actions, r, pp_size, num_microbatches, virtual_stages, placement)
    match = pair_messages(schedules, pp_size, placement)
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


