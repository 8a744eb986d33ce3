"""Pipeline schedules as data: built schedules pass the validator, broken ones fail it, simulated bubbles
match the textbook formulas, in-flight activations stay bounded, and the CLI runs. No processes."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import warnings

import pytest

from pipetrain.parallel.pipeline.schedules import (B, COMM_KINDS, F, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, W, Action,
                                                   build_all_schedules, build_schedule, ideal_bubble, peak_in_flight,
                                                   schedule_problems, simulate, validate_schedule)
from pipetrain.parallel.pipeline.schedules.replay import replay_computes
from pipetrain.parallel.pipeline.schedules.timeline import render_timeline
from tests.harness import run_script

PP_SIZES = range(1, 9)
MICROBATCHES = range(1, 17)
# The simulator model has no approximation: the bubble is exact up to float round-off of sums of a few
# hundred costs such as 1/3, i.e. ~1e-15; 1e-9 leaves room without hiding a one-slot (>= 1e-3) error.
EXACT = 1e-9


def build(name: str, pp_size: int, num_microbatches: int, virtual_stages: int = 1, **kw) -> list[list[Action]]:
    with warnings.catch_warnings():  # 1f1b warns when microbatches < pp; covered by its own test
        warnings.simplefilter("ignore")
        return build_all_schedules(name, pp_size, num_microbatches, virtual_stages, **kw)


def interleaved_cases() -> list[tuple[int, int, int]]:
    return [(p, m, v) for v in (2, 3) for p in range(2, 9) for m in range(p, 17, p)]


def interleaved_bound(pp_rank: int, pp_size: int, num_microbatches: int, virtual_stages: int) -> int:
    return min(2 * (pp_size - pp_rank - 1) + (virtual_stages - 1) * pp_size + 1, num_microbatches * virtual_stages)


# ---------------------------------------------------------------------------------------------------------
# The validator accepts everything the builders produce.

@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp_size", PP_SIZES)
def test_validator_accepts_every_gpipe_and_1f1b_schedule(name, pp_size):
    for m in MICROBATCHES:
        validate_schedule(build(name, pp_size, m), pp_size, m)


def test_validator_accepts_every_interleaved_schedule():
    for p, m, v in interleaved_cases():
        validate_schedule(build("interleaved-1f1b", p, m, v), p, m, v)


@pytest.mark.parametrize("backward_cost", [0.5, 1.0, 3.0])
def test_schedules_placed_for_any_cost_ratio_are_deadlock_free(backward_cost):
    for name, p, m, v in [("gpipe", 4, 6, 1), ("1f1b", 5, 7, 1), ("1f1b", 4, 2, 1),
                          ("interleaved-1f1b", 2, 8, 3), ("interleaved-1f1b", 4, 8, 2), ("interleaved-1f1b", 3, 3, 2)]:
        validate_schedule(build(name, p, m, v, backward_cost=backward_cost), p, m, v)


# ---------------------------------------------------------------------------------------------------------
# Split backward (W actions): valid, never slower, ZB-H1's bubble for 1F1B, bounded memory.

def split_cases() -> list[tuple[str, int, int, int]]:
    return ([(name, p, m, 1) for name in ("gpipe", "1f1b") for p in PP_SIZES for m in MICROBATCHES]
            + [("interleaved-1f1b", p, m, v) for p, m, v in interleaved_cases()])


def test_split_backward_schedules_are_valid_never_slower_and_hold_no_more_than_the_busiest_rank():
    for name, p, m, v in split_cases():
        whole, split = build(name, p, m, v), build(name, p, m, v, split_backward=True)
        validate_schedule(split, p, m, v, max_in_flight=[max(peak_in_flight(a) for a in whole)] * p)
        for r, actions in enumerate(split):
            # Weight gradients accumulate in B order (a B with no W adds them itself), as without the split;
            # every B but a first-stage one directly followed by its W is split.
            bs = [(a.microbatch, a.chunk) for a in actions if a.kind == B]
            ws = {(a.microbatch, a.chunk) for a in actions if a.kind == W}
            adds = [(a.microbatch, a.chunk) for a in actions if a.kind == W or (a.kind == B and
                                                                              (a.microbatch, a.chunk) not in ws)]
            assert adds == bs, (name, p, m, v)
            compute = [a for a in actions if a.kind in (F, B, W)]
            for i, a in enumerate(compute):
                key = (a.microbatch, a.chunk)
                if a.kind == B and key not in ws:
                    assert r == 0 and a.chunk == 0, (name, p, m, v, r, a)
                if a.kind == W and r == 0 and a.chunk == 0:  # kept split only where something else lies between
                    b = compute.index(Action(B, *key))
                    assert any(x.kind != B or x.chunk for x in compute[b + 1:i]), (name, p, m, v, a)
        if name != "interleaved-1f1b":  # rank 0's split never pays in 1F1B and GPipe: every B stays whole
            assert not any(a.kind == W for a in split[0]), (name, p, m)
        assert simulate(split).makespan <= simulate(whole).makespan + EXACT, (name, p, m, v)


def test_split_1f1b_is_zb_h1_a_third_of_the_bubble():
    # F = I = W = 1 (B = 2): idle per rank (p-1)(F + I - W) = p-1 instead of 3(p-1) (Qi et al. 2023).
    for p in PP_SIZES:
        for m in range(p, 17):
            result = simulate(build("1f1b", p, m, split_backward=True))
            assert result.makespan == pytest.approx(3 * m + (p - 1), abs=EXACT), (p, m)
            assert result.peak_in_flight == [p] * p  # rank 0 holds p, as in 1F1B; the others may too


def test_validator_rejects_a_w_before_its_b_and_a_second_w():
    s = build("1f1b", 2, 2, split_backward=True)  # rank 1's Bs are split (rank 0's W would follow its B)
    w = next(i for i, a in enumerate(s[1]) if a.kind == W)
    b = next(i for i, a in enumerate(s[1]) if a.kind == B and (a.microbatch, a.chunk) == (s[1][w].microbatch, 0))
    early = s[1][:b] + [s[1][w]] + [a for i, a in enumerate(s[1][b:], b) if i != w]
    with pytest.raises(ValueError, match=r"rank 1, action \d+ W\(mb 0\): comes before its backward"):
        validate_schedule([s[0], early], 2, 2)
    with pytest.raises(ValueError, match=r"W\(mb 0\): duplicate of action"):
        validate_schedule([s[0], s[1] + [s[1][w]]], 2, 2)


def test_single_rank_schedules_are_only_compute():
    for name in ("gpipe", "1f1b"):
        (actions,) = build(name, 1, 3)
        assert [a.kind for a in actions if a.kind in COMM_KINDS] == []
        assert sorted((a.kind, a.microbatch) for a in actions) == [(k, i) for k in (B, F) for i in range(3)]


def test_interleaved_with_one_virtual_stage_is_plain_1f1b():
    assert build("interleaved-1f1b", 4, 6, 1) == build("1f1b", 4, 6)


def test_1f1b_steady_state_batches_send_act_with_recv_grad():
    # Megatron's send_forward_recv_backward: without it, rendezvous sends deadlock in steady state.
    p, m = 4, 8
    for r, actions in enumerate(build("1f1b", p, m)[:-1]):
        for i, a in enumerate(actions):
            if a.kind == RECV_GRAD and a.microbatch < m - (p - r - 1):  # a steady-state backward
                run = actions[i - 1::-1]
                run = run[:next(k for k, x in enumerate(run) if x.kind not in COMM_KINDS)]
                assert any(x.kind == SEND_ACT for x in run), f"rank {r} action {i}: {a} not batched with a send"


# ---------------------------------------------------------------------------------------------------------
# The validator rejects broken schedules, naming rank, index and problem.

def two_rank_1f1b() -> list[list[Action]]:
    return [list(s) for s in build("1f1b", 2, 2)]


def test_validator_rejects_backward_before_forward():
    with pytest.raises(ValueError, match=r"rank 0, action 0 B\(mb 0\): comes before its forward"):
        validate_schedule([[Action(B, 0), Action(F, 0)]], 1, 1)


def test_validator_rejects_a_missing_recv():
    s = two_rank_1f1b()
    s[1].remove(Action(RECV_ACT, 1, peer=0))
    i = s[1].index(Action(F, 1))
    with pytest.raises(ValueError, match=rf"rank 1, action {i} F\(mb 1\): comes before its input activation"):
        validate_schedule(s, 2, 2)


def test_validator_rejects_a_missing_backward():
    with pytest.raises(ValueError, match=r"rank 0, action 1: missing B\(mb 0\)"):
        validate_schedule([[Action(F, 0)]], 1, 1)


def test_validator_rejects_a_duplicate_forward():
    with pytest.raises(ValueError, match=r"rank 0, action 1 F\(mb 0\): duplicate of action 0"):
        validate_schedule([[Action(F, 0), Action(F, 0), Action(B, 0)]], 1, 1)


def test_validator_rejects_sends_in_a_different_order_than_receives():
    s = [list(a) for a in build("gpipe", 2, 2)]
    assert s[0][:4] == [Action(F, 0), Action(SEND_ACT, 0, peer=1), Action(F, 1), Action(SEND_ACT, 1, peer=1)]
    s[0][:4] = [Action(F, 0), Action(F, 1), Action(SEND_ACT, 1, peer=1), Action(SEND_ACT, 0, peer=1)]
    with pytest.raises(ValueError, match=r"rank 1, action \d+ RECV_ACT\(mb 0\) <- 0: receive #0 from rank 0 is "
                                         r"paired by order with SEND_ACT\(mb 1\)"):
        validate_schedule(s, 2, 2)


def test_validator_rejects_a_wrong_peer_and_talking_past_the_last_stage():
    with pytest.raises(ValueError, match=r"rank 1, action \d+ SEND_ACT\(mb 0\) -> 1: peer must be rank 0"):
        s = two_rank_1f1b()
        s[1].insert(2, Action(SEND_ACT, 0, peer=1))
        validate_schedule(s, 2, 2)
    with pytest.raises(ValueError, match=r"the last stage has no next stage"):
        s = two_rank_1f1b()
        s[1].insert(2, Action(SEND_ACT, 0, peer=0))
        validate_schedule(s, 2, 2)


def test_validator_rejects_a_missing_send():
    s = two_rank_1f1b()
    s[1].remove(Action(SEND_GRAD, 1, peer=0))
    with pytest.raises(ValueError, match=r"rank 1, action \d+: missing SEND_GRAD\(mb 1\) \(stage 1\)"):
        validate_schedule(s, 2, 2)


def test_validator_rejects_an_order_that_deadlocks_under_any_semantics():
    # Each rank waits for the other: rank 0 for a gradient before sending the activation it needs.
    s = [[Action(F, 0), Action(RECV_GRAD, 0, peer=1), Action(SEND_ACT, 0, peer=1), Action(B, 0)],
         [Action(RECV_ACT, 0, peer=0), Action(F, 0), Action(B, 0), Action(SEND_GRAD, 0, peer=0)]]
    with pytest.raises(ValueError, match=r"deadlock under async semantics: rank 0 at action 1 RECV_GRAD\(mb 0\) "
                                         r"<- 1 waits for rank 1 to reach action 3"):
        validate_schedule(s, 2, 1)


def test_validator_rejects_an_order_that_deadlocks_only_under_rendezvous():
    # Rank 0's send of activation 2 and rank 1's send of gradient 0 each sit in their own batch, and each
    # matching receive comes after a compute: fine with eager sends, a cycle when sends wait for receivers.
    a, g = (lambda i: Action(SEND_ACT, i, peer=1)), (lambda i: Action(RECV_GRAD, i, peer=1))
    r0 = [Action(F, 0), a(0), Action(F, 1), a(1), Action(F, 2), a(2), Action(F, 3), g(0), Action(B, 0), a(3),
          g(1), Action(B, 1), g(2), Action(B, 2), g(3), Action(B, 3)]
    ra, sg = (lambda i: Action(RECV_ACT, i, peer=0)), (lambda i: Action(SEND_GRAD, i, peer=0))
    r1 = [ra(0), Action(F, 0), ra(1), Action(B, 0), sg(0), Action(F, 1), ra(2), Action(F, 2), Action(B, 1), sg(1),
          ra(3), Action(F, 3), Action(B, 2), sg(2), Action(B, 3), sg(3)]
    validate_schedule([r0, r1], 2, 4, semantics=("async",))
    with pytest.raises(ValueError, match=r"deadlock under rendezvous semantics: rank 0 at action 5 "
                                         r"SEND_ACT\(mb 2\) -> 1 waits for rank 1 to reach action 6"):
        validate_schedule([r0, r1], 2, 4)


def test_validator_rejects_exceeding_an_in_flight_bound():
    p, m = 4, 8
    with pytest.raises(ValueError, match=r"rank 0 holds 8 microbatches in flight, above its bound 4; "
                                         r"peaks per rank: \[8, 8, 8, 8\]"):
        validate_schedule(build("gpipe", p, m), p, m, max_in_flight=[p - r for r in range(p)])


# ---------------------------------------------------------------------------------------------------------
# Builder arguments.

# The user-facing layout check reports these before a run starts; the builders assert them.
@pytest.mark.parametrize("name, pp_size, num_microbatches, virtual_stages, problem", [
    ("interleaved-1f1b", 4, 6, 2, r"parallel.microbatches=6 must be a multiple of parallel.pp=4.*use 8"),
    ("interleaved-1f1b", 1, 4, 2, r"needs parallel.pp >= 2"),
    ("1f1f", 2, 4, 1, r"parallel.schedule='1f1f' is unknown.*did you mean '1f1b'"),
    ("1f1b", 2, 4, 2, r"parallel.virtual_stages=2 needs parallel.schedule=interleaved-1f1b"),
    ("gpipe", 0, 4, 1, r"parallel.pp must be >= 1, got 0"),
    ("gpipe", 2, 0, 1, r"parallel.microbatches must be >= 1, got 0"),
])
def test_schedule_problems_name_the_rule_and_the_builders_assert_it(name, pp_size, num_microbatches,
                                                                      virtual_stages, problem):
    problems = schedule_problems(name, pp_size, num_microbatches, virtual_stages)
    assert len(problems) == 1 and re.search(problem, problems[0]), problems
    with pytest.raises(AssertionError, match=problem):
        build_all_schedules(name, pp_size, num_microbatches, virtual_stages)


def test_schedule_problems_accept_every_buildable_layout():
    for name, p, m, v in split_cases():
        assert schedule_problems(name, p, m, v) == [], (name, p, m, v)


def test_a_rank_outside_the_pipeline_is_an_internal_error():
    for rank in (2, -1):
        with pytest.raises(AssertionError, match=rf"pp_rank must be in \[0, 2\), got {rank}"):
            build_schedule("gpipe", rank, 2, 4)


def test_1f1b_with_fewer_microbatches_than_stages_warns_but_stays_valid():
    with pytest.warns(UserWarning, match=r"num_microbatches=2 < pp_size=4; the pipeline never reaches steady"):
        s = build_all_schedules("1f1b", 4, 2)
    validate_schedule(s, 4, 2, max_in_flight=[2, 2, 2, 1])


# ---------------------------------------------------------------------------------------------------------
# In-flight activations.

def test_1f1b_keeps_at_most_pp_minus_rank_microbatches_in_flight():
    for p in PP_SIZES:
        for m in MICROBATCHES:
            s = build("1f1b", p, m)
            validate_schedule(s, p, m, max_in_flight=[p - r for r in range(p)])
            assert [peak_in_flight(a) for a in s] == [min(p - r, m) for r in range(p)]


def test_gpipe_keeps_every_microbatch_in_flight():
    for p in PP_SIZES:
        for m in MICROBATCHES:
            assert [peak_in_flight(a) for a in build("gpipe", p, m)] == [m] * p


def test_interleaved_in_flight_matches_its_warmup_bound():
    for p, m, v in interleaved_cases():
        peaks = [peak_in_flight(a) for a in build("interleaved-1f1b", p, m, v)]
        assert peaks == [interleaved_bound(r, p, m, v) for r in range(p)], (p, m, v)


# ---------------------------------------------------------------------------------------------------------
# Simulated bubbles against the formulas.

def test_simulator_reproduces_a_hand_computed_two_rank_1f1b():
    # pp 2, 2 microbatches, F = 1, B = 2. Rank 0: F0 [0,1] F1 [1,2], waits for rank 1's B0, B0 [4,6], waits
    # for rank 1's B1, B1 [7,9]. Rank 1: waits for F0, F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7], then idle.
    # Makespan 9; each rank computes 6 and idles 3 (rank 0 in the middle, rank 1 at both ends).
    orders = [[(F, 0, 0), (F, 1, 0), (B, 0, 0), (B, 1, 0)], [(F, 0, 0), (B, 0, 0), (F, 1, 0), (B, 1, 0)]]
    sim = replay_computes(orders, 1, lambda r, x: {F: 1.0, B: 2.0}[x[0]])
    assert sim.starts == [[0, 1, 4, 7], [1, 2, 4, 5]]
    assert sim.ends == [[1, 2, 6, 9], [2, 4, 5, 7]]
    assert sim.clock == [9, 7]
    result = simulate(build("1f1b", 2, 2), cost_f=1.0, cost_b=2.0)
    assert result.makespan == 9 and result.bubble_per_rank == pytest.approx([3 / 9, 3 / 9], abs=EXACT)
    computes = [[(a.kind, a.microbatch, start) for a, start in zip(actions, starts) if a.kind in (F, B)]
                for actions, starts in zip(result.schedules, result.starts)]
    assert computes == [[(kind, mb, t) for (kind, mb, _), t in zip(order, ts)]
                        for order, ts in zip(orders, sim.starts)]
    # Each transfer taking 0.5 puts both hops of the critical path (F0 down, B1 up) 0.5 later: makespan 10.
    slow = simulate(build("1f1b", 2, 2), cost_f=1.0, cost_b=2.0, cost_comm=0.5)
    assert slow.makespan == 10 and slow.bubble_per_rank == pytest.approx([4 / 10, 4 / 10], abs=EXACT)


@pytest.mark.parametrize("cost_b", [1.0, 2.0, 3.0])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, cost_b):
    # Receives are placed for B=2F; these schedules reach the formula at any real ratio anyway.
    for p in PP_SIZES:
        for m in MICROBATCHES:
            result = simulate(build(name, p, m), cost_f=1.0, cost_b=cost_b)
            assert result.bubble == pytest.approx(ideal_bubble(p, m), abs=EXACT), (p, m)
            assert result.makespan == pytest.approx((m + p - 1) * (1.0 + cost_b), abs=EXACT)


@pytest.mark.parametrize("cost_b", [1.0, 2.0, 3.0])
def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1_when_placed_for_the_real_costs(cost_b):
    for p, m, v in interleaved_cases():
        result = simulate(build("interleaved-1f1b", p, m, v, backward_cost=cost_b), cost_f=1.0, cost_b=cost_b)
        assert result.bubble == pytest.approx(ideal_bubble(p, m, v), abs=EXACT), (p, m, v)
        assert result.bubble_per_rank == pytest.approx([ideal_bubble(p, m, v)] * p, abs=EXACT)


def test_interleaving_shrinks_the_bubble_about_v_fold():
    p, m = 4, 16
    plain = simulate(build("1f1b", p, m)).bubble
    for v in (2, 3):
        ratio = plain / simulate(build("interleaved-1f1b", p, m, v)).bubble
        assert ratio == pytest.approx((v * m + p - 1) / (m + p - 1), abs=EXACT)
        assert 0.8 * v < ratio < v  # "about v times smaller": the (p-1) terms keep it just under v


def test_interleaved_placed_for_other_costs_is_slower_but_still_beats_gpipe():
    # Receives placed for B=2F block early when B=F really: correct, with a bubble between the formulas.
    p, m, v = 4, 8, 2
    result = simulate(build("interleaved-1f1b", p, m, v), cost_f=1.0, cost_b=1.0)
    assert ideal_bubble(p, m, v) + 0.01 < result.bubble < ideal_bubble(p, m)


def test_comm_latency_lengthens_the_critical_path():
    p, m, c = 4, 8, 0.25
    base, slow = simulate(build("1f1b", p, m)), simulate(build("1f1b", p, m), cost_comm=c)
    assert slow.makespan >= base.makespan + 2 * (p - 1) * c - EXACT  # one hop down and one up per rank pair
    assert slow.bubble > base.bubble


def test_simulator_reports_peak_in_flight_and_rejects_deadlocks():
    assert simulate(build("1f1b", 4, 8)).peak_in_flight == [4, 3, 2, 1]
    stuck = [[Action(F, 0), Action(RECV_GRAD, 0, peer=1), Action(SEND_ACT, 0, peer=1), Action(B, 0)],
             [Action(RECV_ACT, 0, peer=0), Action(F, 0), Action(B, 0), Action(SEND_GRAD, 0, peer=0)]]
    with pytest.raises(ValueError, match=r"simulate: deadlock: rank 0 at action 1"):
        simulate(stuck)


def test_timeline_has_one_row_per_rank_with_labels_and_idle_share():
    text = render_timeline(simulate(build("interleaved-1f1b", 2, 4, 2)))
    rows = text.splitlines()
    assert [r.split("|")[0] for r in rows[:2]] == ["rank 0 ", "rank 1 "]
    assert "F0c0" in rows[0] and "B3c0" in rows[1] and "idle" in rows[0]
    assert len({len(r) for r in rows[:2]}) == 1  # rows are aligned


# ---------------------------------------------------------------------------------------------------------
# CLI.

def run_cli(*args: str) -> subprocess.CompletedProcess:
    return run_script("pipetrain.parallel.pipeline.schedules", list(args), timeout=60)


def test_cli_prints_timeline_and_bubble():
    out = run_cli("--schedule", "1f1b", "--pp", "4", "--microbatches", "8")
    assert out.returncode == 0, out.stderr
    assert "rank 3 |" in out.stdout and "bubble 27.3%" in out.stdout
    out = run_cli("--schedule", "interleaved-1f1b", "--pp", "4", "--microbatches", "8", "--virtual-stages", "2")
    assert out.returncode == 0, out.stderr
    assert "F7c1" in out.stdout and "bubble 15.8%" in out.stdout


def test_cli_reports_bad_input_in_one_line_with_exit_2():
    out = run_cli("--schedule", "interleaved-1f1b", "--pp", "4", "--microbatches", "6")
    assert out.returncode == 2
    assert out.stderr.startswith("error: parallel.microbatches=6 must be a multiple of parallel.pp=4")
    assert "Traceback" not in out.stderr


def test_cli_png_needs_matplotlib_or_writes_the_file(tmp_path):
    png = tmp_path / "t.png"
    out = run_cli("--pp", "2", "--microbatches", "2", "--png", str(png))
    if importlib.util.find_spec("matplotlib") is None:
        assert out.returncode == 2 and "needs matplotlib" in out.stderr and "rank 1 |" in out.stdout
    else:
        assert out.returncode == 0, out.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_exhaustive_sweep_validates_and_matches_the_formulas():
    # Wider than the default run: more microbatches, v up to 4, several placement/cost ratios.
    for cost_b in (1.0, 2.0, 3.0):
        for p in range(1, 9):
            for m in range(1, 33):
                for name, v in [("gpipe", 1), ("1f1b", 1)] + [("interleaved-1f1b", v) for v in (2, 3, 4)]:
                    if v > 1 and (p == 1 or m % p):
                        continue
                    s = build(name, p, m, v, backward_cost=cost_b)
                    validate_schedule(s, p, m, v, max_in_flight=[m * v] * p if name != "1f1b" else
                                      [p - r for r in range(p)])
                    bubble = simulate(s, cost_f=1.0, cost_b=cost_b).bubble
                    assert bubble == pytest.approx(ideal_bubble(p, m, v), abs=EXACT), (name, p, m, v, cost_b)


def test_more_microbatches_than_a_schedule_is_built_for_are_refused_in_one_line():
    """A review found `--dry-run` with parallel.microbatches=1e6 at pp 2 silent for minutes (the schedule is built,
    checked and simulated in Python before a run), and the planner counting to a global batch of 1e9."""
    from pipetrain.parallel.pipeline.schedules.builders import MAX_MICROBATCHES, schedule_problems
    from pipetrain.parallel.pipeline.schedules.timeline import main as timeline
    from pipetrain.plan.search import _divisors
    assert not schedule_problems("1f1b", 2, MAX_MICROBATCHES)
    assert any(f"parallel.microbatches={MAX_MICROBATCHES + 1} is more than" in p
               for p in schedule_problems("1f1b", 2, MAX_MICROBATCHES + 1))
    assert timeline(["--pp", "4", "--microbatches", "1000000000"]) == 2
    assert _divisors(2 ** 40) == [2 ** k for k in range(41)]  # O(sqrt n): counting to 2**40 never ends
