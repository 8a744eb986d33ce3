"""The schedules: each rank's compute order for GPipe, 1F1B, interleaved 1F1B and the V schedules (zbv,
dualpipev), and the entry points.

A builder fixes every rank's order of F and B; placement.place then adds W (split backward) and the
SEND/RECV actions. The arguments are checked by the user-facing layout check before they get here;
schedule_problems states this module's rules, and the builders assert them.
"""
from __future__ import annotations

import difflib
import warnings

from pipetrain.parallel.pipeline.schedules.actions import (B, F, SCHEDULES, V_SCHEDULES, W, Action, Compute, source,
                                                           stage_of)
from pipetrain.parallel.pipeline.schedules.placement import place
from pipetrain.parallel.pipeline.schedules.replay import Replay, Task, replay_computes

# A schedule is data: a few actions per microbatch and rank, built, checked and simulated in Python before a run.
# Past this many microbatches that takes minutes (20,000 at pp 2: ~25 s of a dry run); runs use hundreds.
MAX_MICROBATCHES = 8192


def schedule_problems(name: str, pp_size: int, num_microbatches: int, virtual_stages: int = 1) -> list[str]:
    """Every reason schedule `name` cannot be built for these sizes (empty when it can), in the recipe's
    terms (parallel.schedule, pp, microbatches, virtual_stages): pipetrain.parallel.mesh.rules reports them
    to the user before a run, the timeline command before drawing, and the builders assert them."""
    p, m, v = pp_size, num_microbatches, virtual_stages
    problems = [f"parallel.{what} must be >= 1, got {value}"
                for what, value in (("pp", p), ("microbatches", m), ("virtual_stages", v)) if value < 1]
    if m > MAX_MICROBATCHES:
        problems.append(f"parallel.microbatches={m} is more than {MAX_MICROBATCHES} a step (each is a few actions per "
                        "rank, built and simulated before the run); make each microbatch hold more sequences")
    if name not in SCHEDULES:
        close = difflib.get_close_matches(name, SCHEDULES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        problems.append(f"parallel.schedule={name!r} is unknown, expected one of {', '.join(SCHEDULES)}{hint}")
    elif name in V_SCHEDULES:
        if v != 2:
            problems.append(f"parallel.schedule={name} places two chunks per rank in a V, so it needs "
                            f"parallel.virtual_stages=2, got {v}; set parallel.virtual_stages=2")
        if p < 2:
            problems.append(f"parallel.schedule={name} needs parallel.pp >= 2, got {p}; on one rank use schedule 1f1b")
        if name == "dualpipev" and m < 2 * p:
            problems.append(f"parallel.microbatches={m} must be >= 2*parallel.pp={2 * p} for dualpipev (its steady "
                            f"state feeds a microbatch into each of the 2*pp stages); use {2 * p} or more, or zbv")
    elif v > 1 and name != "interleaved-1f1b":
        problems.append(f"parallel.virtual_stages={v} needs parallel.schedule=interleaved-1f1b, got {name}; "
                        "set parallel.virtual_stages=1 or use interleaved-1f1b")
    elif v > 1 and p == 1:
        problems.append(f"parallel.virtual_stages={v} needs parallel.pp >= 2, got 1; one rank has no bubble "
                        "to shrink, so use schedule 1f1b (or virtual_stages=1)")
    elif v > 1 and p > 1 and m % p:
        problems.append(f"parallel.microbatches={m} must be a multiple of parallel.pp={p} for interleaved-1f1b "
                        f"(microbatches pass through the chunks in groups of pp); use {m + p - m % p}")
    return problems


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


# zbv keeps the paper's fixed order unless a list-scheduled one replays more than this much shorter. The
# replay's stage costs are FLOP estimates with free transfers: on the benchmark's CPU, orders it put within
# 1% of each other measured 8-12% apart, always in the fixed order's favour (docs/benchmarks.md). What the
# margin lets through is structural: the fixed order's longer fill with few microbatches (m near p).
ZBV_FIXED_MARGIN = 0.05


def zbv_orders(pp_size: int, num_microbatches: int, stage_costs=None,
               backward_cost: float = 2.0) -> dict[str, list[list[Compute]]]:
    """ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"): candidate F, B and W orders
    of every rank by name: "equal", "costed" (given uneven stage_costs) and "fixed", the paper's
    (zbv_fixed_order). build_all_schedules keeps the fixed order unless another replays more than
    ZBV_FIXED_MARGIN shorter on the stage costs.

    Built by list scheduling on the simulator (_zbv_list_schedule) with F = B = W = 1 per chunk, and, given
    stage_costs (forward time of each of the 2p stages, any unit), again on those costs (v_duration), with
    chunk 0 kept at most 2 (p-1-r) + 1 forwards ahead of chunk 1 on rank r (the forwards ZB-V's warm-up runs
    before its first chunk-1 input can arrive; without that cap, uneven costs let a rank fill its activation
    budget with chunk-0 forwards and the schedule deadlocks)."""
    uniform = _zbv_list_schedule(pp_size, num_microbatches, lambda r, x: 1.0)
    assert uniform is not None, "zbv_orders: list scheduling stalled"
    orders = {"equal": uniform}
    if stage_costs is not None and len(set(stage_costs)) > 1:
        assert len(stage_costs) == 2 * pp_size and min(stage_costs) > 0, \
            f"zbv_orders: need {2 * pp_size} positive stage costs, got {list(stage_costs)}"
        costed = _zbv_list_schedule(pp_size, num_microbatches, v_duration(stage_costs, pp_size, backward_cost),
                                    ahead=lambda r: 2 * (pp_size - 1 - r) + 1)
        if costed is not None:
            orders["costed"] = costed
    orders["fixed"] = [zbv_fixed_order(r, pp_size, num_microbatches) for r in range(pp_size)]
    return orders


def zbv_fixed_order(pp_rank: int, pp_size: int, num_microbatches: int) -> list[Compute]:
    """Rank r's order in the ZB-V paper's hand-built schedule (the one torch's ScheduleZBVZeroBubble runs).

    Warm-up: 2(p-r)-1 chunk-0 forwards, r pairs (F1, F0), then p-r rounds of F1 B1 W1. Steady state:
    F0 B0 W0 F1 B1 W1 until every microbatch went forward through both chunks. Drain: r pairs (B0, B1)
    without their W, p-r rounds of B0 W0, then the chunk-1 and chunk-0 Ws left. Its timing assumes equal
    F, B and W; where a list-scheduled order replays clearly shorter (few microbatches) build_all_schedules
    takes that one instead. With fewer than 2p-1 microbatches the pattern is built for 2p-1 and the
    computes of the missing microbatches are dropped, as torch does."""
    p, r, m = pp_size, pp_rank, num_microbatches
    n = max(m, 2 * p - 1)
    order: list[Compute] = []
    done = {(kind, c): 0 for kind in (F, B, W) for c in (0, 1)}

    def do(*computes: tuple[str, int]) -> None:
        for kind, c in computes:
            order.append((kind, done[(kind, c)], c))
            done[(kind, c)] += 1

    do(*[(F, 0)] * (2 * (p - r) - 1))
    for _ in range(r):
        do((F, 1), (F, 0))
    for _ in range(p - r):
        do((F, 1), (B, 1), (W, 1))
    while done[(F, 1)] < done[(F, 0)] or done[(F, 0)] < n:
        if done[(F, 0)] < n:
            do((F, 0))
        do((B, 0), (W, 0), (F, 1), (B, 1), (W, 1))
    for _ in range(r):
        do((B, 0), (B, 1))
    for _ in range(p - r):
        do((B, 0), (W, 0))
    do(*[(W, 1)] * (done[(B, 1)] - done[(W, 1)]), *[(W, 0)] * (done[(B, 0)] - done[(W, 0)]))
    return [x for x in order if x[1] < m]


def v_duration(stage_costs, pp_size: int, backward_cost: float, orders=None):
    """duration(rank, compute) on a V placement's stage costs: F = c, and the backward's c * backward_cost
    split in half between B and W, or all on B where a rank's order has no W for it (merged)."""
    merged = None if orders is None else [{(mb, c) for k, mb, c in o if k == B} - {(mb, c) for k, mb, c in o if k == W}
                                          for o in orders]

    def duration(r: int, x: Compute) -> float:
        kind, mb, chunk = x
        forward = stage_costs[stage_of(r, chunk, pp_size, "v")]
        if kind == F:
            return forward
        whole = merged is not None and kind == B and (mb, chunk) in merged[r]
        return forward * backward_cost * (1.0 if whole else 0.5)
    return duration


def v_makespan(schedules, stage_costs, backward_cost: float) -> float:
    """Length of a V schedule's computes replayed on stage_costs (free transfers)."""
    orders = [[(a.kind, a.microbatch, a.chunk) for a in acts if a.kind in (F, B, W)] for acts in schedules]
    duration = v_duration(stage_costs, len(schedules), backward_cost, orders)
    return max(replay_computes(orders, 2, duration, "v").clock)


def _zbv_list_schedule(pp_size: int, num_microbatches: int, duration, ahead=None) -> list[list[Compute]] | None:
    """Each rank, whenever it is free, does the backward whose output gradient is there (oldest first: it
    frees memory and unblocks the ranks upstream), else the forward whose input is there (chunk 1 first, it
    is closer to the loss), else its oldest pending W (a W needs nothing from another rank, so it fills what
    would be a wait), else it waits for the earliest known input; tasks take duration(rank, compute).
    Forwards stop while the rank holds 2*pp_size (microbatch, chunk) activations not yet weight-gradiented:
    p microbatches of the whole rank's layers, 1F1B's peak on rank 0; ahead(r), when given, caps how many
    chunk-0 forwards rank r runs ahead of its chunk-1 ones. F and B run each chunk's microbatches in order,
    W each chunk's in B order, so weight gradients accumulate in microbatch order. None if it stalls."""
    p, m = pp_size, num_microbatches
    limit = 2 * p
    next_f, next_b = [[0, 0] for _ in range(p)], [[0, 0] for _ in range(p)]
    pending: list[list[Compute]] = [[] for _ in range(p)]
    live = [0] * p
    out: list[list[Compute]] = [[] for _ in range(p)]
    sim = Replay(p)

    def may_forward(r: int, c: int) -> bool:
        if next_f[r][c] >= m or live[r] >= limit:
            return False
        return ahead is None or c == 1 or next_f[r][0] - next_f[r][1] < ahead(r)

    def candidates(r: int) -> list[tuple[float, int, Compute, object]]:
        found = []
        for c in (1, 0):
            if next_b[r][c] < next_f[r][c]:  # its forward is done: B can run once its gradient is there
                x = (B, next_b[r][c], c)
                found.append((0, c, x))
            if may_forward(r, c):
                found.append((1, 1 - c, (F, next_f[r][c], c)))
        out_ = []
        for rank_, _, x in found:
            src = source(p, 2, r, x, "v")
            at = sim.clock[r] if src is None else sim.produced.get(src)
            if at is not None:
                out_.append((max(at, sim.clock[r]), rank_, x, src))
        return out_

    def next_task(r: int) -> Task | None:
        ready = candidates(r)
        now = [c for c in ready if c[0] <= sim.clock[r]]
        if now:
            _, _, x, src = min(now, key=lambda c: (c[1], c[2][1]))  # B before F, then the oldest microbatch
        elif pending[r]:
            x, src = pending[r].pop(0), None
        elif ready:
            _, _, x, src = min(ready, key=lambda c: (c[0], c[1], c[2][1]))
        else:
            return None
        kind, mb, c = x
        if kind == F:
            next_f[r][c] += 1
            live[r] += 1
        elif kind == B:
            next_b[r][c] += 1
            pending[r].append((W, mb, c))
        else:
            live[r] -= 1
        out[r].append(x)
        return Task(duration(r, x), needs=src, makes=(r, x))

    sim.drive(next_task)
    return out if all(len(order) == 6 * m for order in out) else None


def _dualpipev_order(pp_rank: int, pp_size: int, num_microbatches: int) -> list[Compute]:
    """DualPipeV (DeepSeek-V3's DualPipe cut to one V, as in torch.distributed.pipelining): rank r's order.

    Chunk 0 (stage r) and chunk 1 (stage 2p-1-r) of every rank: fill with 2(p-r-1) chunk-0 forwards,
    then r+1 forward pairs (chunk 0, chunk 1); p-r-1 rounds of B1 W1 F1 (the split backward fills the
    wait for the first gradients); the steady state pairs each forward with a backward of the other
    chunk (F0 B1, F1 B0: DualPipe overlaps the pair's compute with the other's communication); the
    drain mirrors the fill, splitting the later backwards and doing their W at the end. B is split
    (followed later by its W) only where a W fills a wait; elsewhere it does the whole backward.
    """
    p, r, m = pp_size, pp_rank, num_microbatches
    order: list[Compute] = []
    count = {(kind, c): 0 for kind in (F, B) for c in (0, 1)}
    pending: list[Compute] = []

    def add(kind: str, c: int, split: bool = False) -> None:
        mb = count[(kind, c)]
        count[(kind, c)] += 1
        order.append((kind, mb, c))
        if split:
            pending.append((W, mb, c))

    def weight() -> None:
        if pending:
            order.append(pending.pop(0))

    for _ in range(2 * (p - r - 1)):
        add(F, 0)
    for _ in range(r + 1):
        add(F, 0)
        add(F, 1)
    for _ in range(p - r - 1):
        add(B, 1, split=True)
        weight()
        add(F, 1)
    for _ in range(m - 2 * p + r + 1):
        add(F, 0)
        add(B, 1)
        add(F, 1)
        add(B, 0)
    for _ in range(p - r - 1):
        add(B, 1)
        add(F, 1)
        add(B, 0)
    for i in range(r + 1):  # the second half of the drain splits its backwards
        add(B, 1, split=i >= (r + 1) // 2)
        add(B, 0, split=i >= (r + 1) // 2)
    for _ in range(p - r - 1):
        weight()
        add(B, 0, split=True)
    while pending:
        weight()
    return order


def build_all_schedules(name: str, pp_size: int, num_microbatches: int, virtual_stages: int = 1, *,
                        backward_cost: float = 2.0, split_backward: bool = False,
                        stage_costs=None) -> list[list[Action]]:
    """Every rank's action list for schedule `name`: one call instead of pp_size (validator, simulator).

    backward_cost is B's time relative to F's, used only to place receives and W actions (placement.py):
    about 2 normally, 3 with full activation recomputation; with split_backward half of it is taken as
    B's input-gradient part and half as W. Any positive value gives a deadlock-free schedule. The V
    schedules (zbv, dualpipev: placement "v", virtual_stages=2) always split their backward and place
    their own W actions; split_backward does not change them. stage_costs (forward time of each stage)
    let zbv order its computes for this partition (zbv_orders); the other schedules have fixed orders.
    """
    problems = schedule_problems(name, pp_size, num_microbatches, virtual_stages)
    assert not problems, "; ".join(problems)
    assert backward_cost > 0, f"schedule: backward_cost must be > 0, got {backward_cost}"
    p, m, v = pp_size, num_microbatches, virtual_stages
    if name == "zbv":
        costs = [1.0] * (2 * p) if stage_costs is None else stage_costs
        placed = {name: place(o, 2, backward_cost, True, "v")
                  for name, o in zbv_orders(p, m, stage_costs, backward_cost).items()}
        length = {name: v_makespan(s, costs, backward_cost) for name, s in placed.items()}
        shortest = min(length, key=length.get)  # on a tie the first
        return placed[shortest] if length[shortest] < (1.0 - ZBV_FIXED_MARGIN) * length["fixed"] else placed["fixed"]
    if name == "dualpipev":
        return place([_dualpipev_order(r, p, m) for r in range(p)], 2, backward_cost, True, "v")
    if name == "gpipe":
        return place([_gpipe_order(m)] * p, 1, backward_cost, split_backward)
    if v == 1:  # 1f1b, and interleaved-1f1b with one chunk per rank, which is the same thing
        if m < p:
            warnings.warn(f"1f1b: num_microbatches={m} < pp_size={p}; the pipeline never reaches steady state "
                          f"and idles {(p - 1) / (m + p - 1):.0%} of the step; use num_microbatches >= pp_size "
                          f"(4*pp_size or more keeps the bubble small)")
        return place([_one_f_one_b_order(r, p, m) for r in range(p)], 1, backward_cost, split_backward)
    return place([_interleaved_order(r, p, m, v) for r in range(p)], v, backward_cost, split_backward)


def build_schedule(name: str, pp_rank: int, pp_size: int, num_microbatches: int, virtual_stages: int = 1, *,
                   backward_cost: float = 2.0, split_backward: bool = False, stage_costs=None) -> list[Action]:
    """Action list of `pp_rank` for schedule `name` (one of SCHEDULES); keywords: build_all_schedules."""
    assert 0 <= pp_rank < pp_size, f"schedule: pp_rank must be in [0, {pp_size}), got {pp_rank}"
    return build_all_schedules(name, pp_size, num_microbatches, virtual_stages, backward_cost=backward_cost,
                               split_backward=split_backward, stage_costs=stage_costs)[pp_rank]


def gpipe(pp_rank: int, pp_size: int, num_microbatches: int) -> list[Action]:
    """GPipe: all forwards, then all backwards; holds all m microbatches in flight. Proven: async, rendezvous."""
    return build_schedule("gpipe", pp_rank, pp_size, num_microbatches)


def one_f_one_b(pp_rank: int, pp_size: int, num_microbatches: int) -> list[Action]:
    """1F1B (PipeDream-Flush): min(p - r - 1, m) warmup forwards, then alternate F and B, then drain the Bs.

    Holds at most p - pp_rank microbatches in flight. num_microbatches < pp_size is allowed (the schedule is
    still correct and deadlock-free; it degenerates towards GPipe with the same bubble) but warns, since
    the bubble (p-1)/(m+p-1) is then at least half the step. Proven: async, rendezvous.
    """
    return build_schedule("1f1b", pp_rank, pp_size, num_microbatches)


def interleaved_one_f_one_b(pp_rank: int, pp_size: int, num_microbatches: int, virtual_stages: int, *,
                            backward_cost: float = 2.0) -> list[Action]:
    """Interleaved 1F1B: v model chunks per rank shrink the bubble to about (p-1)/(v*m + p-1).

    Needs num_microbatches % pp_size == 0 (microbatches move through the chunks in groups of pp_size) and
    pp_size >= 2 when virtual_stages >= 2; virtual_stages == 1 is plain 1F1B. Holds at most
    min(2*(p - r - 1) + (v-1)*p + 1, m*v) (microbatch, chunk) units in flight, each 1/v of a rank's layers.
    Unlike GPipe and 1F1B its bubble depends on backward_cost matching the real B/F ratio (see
    build_all_schedules). Proven: async, rendezvous.
    """
    return build_schedule("interleaved-1f1b", pp_rank, pp_size, num_microbatches, virtual_stages,
                          backward_cost=backward_cost)
