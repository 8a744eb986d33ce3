"""The auto-parallel planner: per-rank memory (memory.py), device profiles (devices.py, calibrate.py), step-time
cost (cost.py), the exhaustive layout search (search.py), parallel.auto at launch (auto.py), and the CLI
(python -m pipetrain.plan). docs/planner.md describes the models and their measured accuracy."""
from __future__ import annotations

from pipetrain.plan.search import Plan

GIB = 2 ** 30


def plan_header() -> str:
    return (f"{'#':>3} {'dp':>3} {'tp':>3} {'sp':>2} {'pp':>3} {'cp':>3} {'schedule':<16} {'v':>2} {'split':>5} "
            f"{'mb':>4} {'zero':>4} {'recompute':<9} | {'param':>6} {'grad':>6} {'optim':>6} {'act':>6} {'comm':>6} "
            f"{'peak':>6} GiB | {'compute':>8} {'tp':>7} {'cp':>7} {'bubble':>12} {'dp exp/all':>15} {'step s':>8} "
            "| tok/s")


def format_plan_row(index: int, plan: Plan) -> str:
    """One table row: the layout, the busiest rank's memory by kind, the step time by part."""
    l, t = plan.layout, plan.time
    r = max(plan.workers, key=lambda m: m.total)
    return (f"{index:>3} {l['dp']:>3} {l['tp']:>3} {('y' if l['sequence_parallel'] else '-'):>2} {l['pp']:>3} "
            f"{l['cp']:>3} {l['schedule']:<16} {l['virtual_stages']:>2} {('y' if l['split_backward'] else '-'):>5} "
            f"{l['microbatches']:>4} {l['zero']:>4} {l['recompute']:<9} | {r.params / GIB:6.2f} {r.grads / GIB:6.2f} "
            f"{r.optim / GIB:6.2f} {r.activations / GIB:6.2f} {r.comm / GIB:6.2f} {r.total / GIB:6.2f}     | "
            f"{t.compute:8.3g} {t.tp_comm:7.2g} {t.cp_comm:7.2g} {t.bubble:6.2g} ({t.bubble_fraction:3.0%}) "
            f"{t.dp_exposed:7.2g}/{t.dp_comm:<7.2g} {t.total:8.3g} | {t.tokens_per_s:,.0f}")
