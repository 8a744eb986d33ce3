"""From compute orders to action lists: where W actions and SEND/RECV actions go.

A builder (builders.py) fixes each rank's order of F and B; place() turns those orders into the
action lists the executor runs, by timing them once on the simulator (replay.py) with reference costs.

Split backward (zero-bubble pipelining, Qi et al. 2023): with split_backward=True every B computes only
what the previous stage waits for (the input gradient, sent at once) and a later W action of the same
(microbatch, chunk) computes the weight gradients (pipetrain.parallel.pipeline.weight_grads). W needs nothing from another
rank, so _place_weight_grads puts each W where its rank would otherwise wait for a message, in B order
(so every weight accumulates its gradients in microbatch order, as without the split), and never lets
a rank hold more microbatches (forwarded, weight gradients not yet done) than the unsplit schedule's
busiest rank does. For 1F1B this is ZB-H1: with the backward's input part I and weight part W each as
long as F (B = I + W = 2F), the idle time per rank drops from (p-1)(F+B) = 3(p-1)F to (p-1)(F+I-W) =
(p-1)F, a third, at the same peak activation memory (rank 0's; later ranks may now hold that many too).
It never makes a schedule slower in the simulator (tests/unit/test_schedules.py sweeps it). A B without a W
is the usual one and does everything: so is every B of a schedule without W actions, and a first-stage
B whose W would follow it with only first-stage Bs between (_merge_first_stage_weight_grads).

How communication is placed (_place_comms): run the compute orders once with reference costs (F=1,
B=backward_cost, default 2; free transfers), every compute starting as soon as its rank is free and its
input exists. A send goes right after the compute that produces it; a receive goes right before the
first compute of the receiving rank that starts no earlier than the message was produced. Under async
timing with those costs no receive ever delays a compute, so the simulated bubble is the compute order's
own (GPipe and 1F1B keep it at any cost ratio; interleaved 1F1B loses some when the real ratio differs).
Under rendezvous (validate.py) no deadlock is possible, for any compute costs: time each batch by the
reference start of the compute after it (the last compute's end for a final batch). If rank A is stuck
at batch X waiting for rank B to reach batch Y while B is stuck at an earlier batch Z, then
time(Z) < time(X): if X sends, Y is B's first batch timed at or after the production, which ends before
time(X), so Z is timed earlier; if X receives, Z precedes the producing compute, which ends no later
than time(X). A waits-for cycle would need time to decrease all the way round, so there is none.
"""
from __future__ import annotations

import bisect
from typing import Sequence

from pipetrain.parallel.pipeline.schedules.actions import (B, F, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, W, Action, Compute,
                                                           rank_chunk_of, source, stage_of)
from pipetrain.parallel.pipeline.schedules.replay import Replay, Task, replay_computes


def place(orders: list[list[Compute]], virtual_stages: int, backward_cost: float,
          split_backward: bool, placement: str = "loop") -> list[list[Action]]:
    """Every rank's action list from its compute order (module docstring), placed for B = backward_cost * F.

    Orders that already hold W actions (the V schedules place their own) only get their communication."""
    has_w = any(kind == W for order in orders for kind, _, _ in order)
    if not split_backward and not has_w:
        return _place_comms(orders, virtual_stages, {F: 1.0, B: backward_cost}, placement)
    cost = {F: 1.0, B: backward_cost / 2, W: backward_cost / 2}
    if not has_w:
        orders = _place_weight_grads(orders, virtual_stages, cost, placement)
    return _place_comms([_merge_first_stage_weight_grads(order, r) for r, order in enumerate(orders)],
                        virtual_stages, cost, placement)


def _in_flight_bound(order: Sequence[Compute]) -> int:
    live = peak = 0
    for kind, _, _ in order:
        live += (kind == F) - (kind == B)
        peak = max(peak, live)
    return peak


def _place_weight_grads(orders: list[list[Compute]], virtual_stages: int, cost: dict[str, float],
                        placement: str = "loop") -> list[list[Compute]]:
    """Give every B of the compute orders a W (module docstring: split backward), placed by a reference run.

    Ranks advance in time order (Replay.drive). A rank whose next compute's input is not there yet does
    its oldest pending W instead of waiting; before an F that would hold more microbatches than the
    unsplit schedule's busiest rank does (rank 0's p in 1F1B) it does one too; at its end it does the rest.
    """
    p = len(orders)
    bound = max(_in_flight_bound(order) for order in orders)
    out: list[list[Compute]] = [[] for _ in range(p)]
    pending: list[list[Compute]] = [[] for _ in range(p)]
    idx, live = [0] * p, [0] * p
    sim = Replay(p)

    def next_task(r: int) -> Task | None:
        if idx[r] == len(orders[r]):
            if not pending[r]:
                return None
            x, src = pending[r].pop(0), None
        else:
            x = orders[r][idx[r]]
            src = source(p, virtual_stages, r, x, placement)
            ready = sim.clock[r] if src is None else sim.produced.get(src)
            # Earliest-clock rank: an input not produced yet can only arrive after its clock.
            if pending[r] and (ready is None or ready > sim.clock[r] or (x[0] == F and live[r] + 1 > bound)):
                x, src = pending[r].pop(0), None
            elif ready is None:
                return None  # blocked with nothing to fill in: let another rank move
            else:
                idx[r] += 1
                if x[0] == B:
                    pending[r].append((W, x[1], x[2]))
        out[r].append(x)
        live[r] += (x[0] == F) - (x[0] == W)
        return Task(cost[x[0]], needs=src, makes=(r, x))

    sim.drive(next_task)
    assert all(idx[r] == len(orders[r]) and not pending[r] for r in range(p)), \
        "_place_weight_grads: compute orders deadlock"
    return out


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


def _place_comms(orders: list[list[Compute]], virtual_stages: int, cost: dict[str, float],
                 placement: str = "loop") -> list[list[Action]]:
    """Add SEND/RECV actions to every rank's compute order (the rule and its proof: module docstring)."""
    p = len(orders)
    last = p * virtual_stages - 1
    # Reference run: a B without a W of its own does the whole backward (cost of B and W).
    split = [{(mb, c) for kind, mb, c in order if kind == W} for order in orders]

    def duration(r: int, x: Compute) -> float:
        kind, mb, c = x
        return cost[kind] + (cost.get(W, 0.0) if kind == B and (mb, c) not in split[r] else 0.0)

    sim = replay_computes(orders, virtual_stages, duration, placement)
    assert all(len(sim.starts[r]) == len(orders[r]) for r in range(p)), "_place_comms: compute orders deadlock"

    # Each receive goes right before the first compute of the receiver that starts no earlier than the
    # message was produced; receives there are ordered by production time, so every directed rank pair
    # receives in the order it sends.
    recvs: list[list[list[tuple[float, Action]]]] = [[[] for _ in order] for order in orders]
    for q, order in enumerate(orders):
        for x in order:
            src = source(p, virtual_stages, q, x, placement)
            if src is not None and src[0] != q:  # the V's local edge is no message
                made = sim.produced[src]
                j = bisect.bisect_left(sim.starts[q], made)  # starts are non-decreasing on a rank
                recvs[q][j].append((made, Action(RECV_ACT if x[0] == F else RECV_GRAD, x[1], x[2], peer=src[0])))
    out: list[list[Action]] = []
    for r, order in enumerate(orders):
        actions: list[Action] = []
        for k, (kind, mb, c) in enumerate(order):
            actions += [a for _, a in sorted(recvs[r][k], key=lambda ta: ta[0])]
            actions.append(Action(kind, mb, c))
            s = stage_of(r, c, p, placement)
            if kind == F and s < last and rank_chunk_of(s + 1, p, placement)[0] != r:
                actions.append(Action(SEND_ACT, mb, c, peer=rank_chunk_of(s + 1, p, placement)[0]))
            elif kind == B and s > 0 and rank_chunk_of(s - 1, p, placement)[0] != r:
                actions.append(Action(SEND_GRAD, mb, c, peer=rank_chunk_of(s - 1, p, placement)[0]))
        out.append(actions)
    return out
