"""Where a training step's time goes, by kind of work: benchmarks/gpu.py's answer to issue 34's "if fp8's gain
is smaller than 1.2x, show from a profile where the step's time goes and what caps it".

profile_step(step, device) runs `step` twice under torch.profiler and sums, per category, the kernels' device
time on CUDA (the self time of the aten ops on the CPU, where only the wiring is checked). Named ranges
(record_function, inductor's "## Call CompiledFxGraph ##", "Optimizer.step") also appear as device events there,
spanning the kernels inside them: they are left out, as torch's own tables leave them out. Categories come from
the kernel names (CATEGORIES, first match wins; the rest is "elementwise and other"):
- gemm: cuBLAS / CUTLASS kernels (nvjet, xmma, gemm), aten's matmuls on the CPU;
- attention: flash / memory-efficient attention;
- fp8 scaling: the kernels that compute amaxes and scales or cast to float8. Inductor names a fused kernel after
  the aten ops in it (on the CPU the quantisation compiles to cpp_fused__to_copy_abs_amax_clamp_exp2_floor_log2_
  mul_reciprocal_view_0), so these are the kernels with amax, clamp or exp2/log2 in their names (nothing else in
  these models clamps), with whatever inductor fused into them;
- optimizer: fused AdamW, multi-tensor kernels;
- communication: NCCL.

amdahl_bound(gemm_fraction, speedup) is what a step could gain at most if only its GEMMs ran `speedup` times
faster (fp8 tensor cores: 2x bf16's peak): 1 / (1 - f + f / speedup).
"""
from __future__ import annotations

import torch

CATEGORIES = (  # attention before gemm (CUTLASS attention kernels), gemm before fp8 scaling (e4m3 GEMMs)
    ("attention", ("flash", "fmha", "attention", "scaled_dot_product")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "triton_tem", "aten::mm", "aten::addmm", "aten::bmm",
              "aten::_scaled_mm")),
    ("fp8 scaling", ("amax", "clamp", "exp2", "log2", "float8", "e4m3", "e5m2")),
    ("optimizer", ("adam", "multi_tensor")),
    ("communication", ("nccl", "c10d")),
)
OTHER = "elementwise and other"
COLUMNS = tuple(name for name, _ in CATEGORIES) + (OTHER,)


def category(name: str) -> str:
    lower = name.lower()
    for label, needles in CATEGORIES:
        if any(n in lower for n in needles):
            return label
    return OTHER


def profile_step(step, device: torch.device, steps: int = 2, top: int = 0):
    """Seconds per step in each category (COLUMNS), from `steps` calls of step() under torch.profiler; with
    top > 0, (those totals, the `top` kernels that took longest: top_kernels, and on CUDA the GPU's idle
    time by host op: idle_by_host_op, and (the profiled step's wall seconds, the seconds a kernel ran in it:
    busy_seconds); both None on the CPU, which has no device timeline)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    if on_cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if on_cuda:
            torch.cuda.synchronize(device)
        wall = (time.perf_counter() - start) / steps
    events = prof.key_averages()
    totals = sum_by_category(events, on_cuda, steps)
    if not top:
        return totals
    if not on_cuda:
        return totals, top_kernels(events, on_cuda, steps, top), None, None
    timeline = prof.events()
    return (totals, top_kernels(events, on_cuda, steps, top), idle_by_host_op(timeline, steps)[:top],
            (wall, busy_seconds(timeline, steps)))


def _timed_events(events, on_cuda: bool):
    """(event, microseconds) of the kernels on CUDA (named ranges skipped), of the ops on the CPU."""
    for event in events:
        if on_cuda:
            if event.device_type != torch.autograd.DeviceType.CUDA or getattr(event, "is_user_annotation", False):
                continue
            yield event, event.self_device_time_total
        else:
            yield event, event.self_cpu_time_total


def top_kernels(events, on_cuda: bool, steps: int, n: int) -> list[tuple[str, str, float, int]]:
    """The n kernels (ops on the CPU) with the most time per step: (name, category, seconds per step, calls
    per step), longest first. What the next change to a step should aim at."""
    timed = sorted(_timed_events(events, on_cuda), key=lambda pair: -pair[1])[:n]
    return [(e.key, category(e.key), us / 1e6 / steps, e.count // steps) for e, us in timed]


def idle_by_host_op(events, steps: int, min_gap_us: float = 100.0) -> list[tuple[str, float, int]]:
    """Where the GPU waited for the host: the gaps of at least min_gap_us between the kernels of the profiled
    steps (the device timeline, kernels merged where they overlap), each put down to the host op that was
    running at the gap's middle: its outermost op (a named range such as Optimizer.step, or an aten op
    called from Python), or "Python, outside any op" when none was. Returns (host op, idle seconds per step,
    gaps per step), most idle first. From prof.events() (each event's time_range, in microseconds)."""
    gaps = [(start, end) for start, end in _gaps(events) if end - start >= min_gap_us]
    # a sweep over the gaps' middles in time order, keeping the host's top-level ops (each thread's outermost:
    # the autograd engine runs the backward's on a thread of its own) that have started and not yet ended
    host = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU
                   and getattr(e, "cpu_parent", None) is None), key=lambda e: e.time_range.start)
    idle: dict[str, list[float]] = {}
    active, next_host = [], 0
    for start, end in gaps:  # in time order
        middle = (start + end) / 2
        while next_host < len(host) and host[next_host].time_range.start <= middle:
            active.append(host[next_host])
            next_host += 1
        active = [e for e in active if e.time_range.end >= middle]
        outer = min(active, key=lambda e: e.time_range.start, default=None)
        name = outer.name if outer is not None else "Python, outside any op"
        idle.setdefault(name, []).append(end - start)
    rows = [(name, sum(us) / 1e6 / steps, len(us) // steps) for name, us in idle.items()]
    return sorted(rows, key=lambda row: -row[1])


def _busy_intervals(events) -> list[tuple[float, float]]:
    """The device timeline: the kernels' (start, end) in microseconds, merged where they overlap (streams),
    in time order. Named ranges (user annotations) span kernels and are no kernel of their own."""
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events
                     if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False))
    merged: list[list[float]] = []
    for start, end in kernels:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _gaps(events) -> list[tuple[float, float]]:
    """Every stretch between two busy intervals of the device timeline, in time order."""
    busy = _busy_intervals(events)
    return [(end, start) for (_, end), (start, _) in zip(busy, busy[1:])]


def busy_seconds(events, steps: int) -> float:
    """Seconds per step in which at least one kernel ran: the profiled step's wall time less this is the time
    the GPU waited, in gaps of any length, measured on the same steps (a timed step less the kernels' total
    mixes two runs, which on a card that changes its clock between them differ by more than the idle time).
    The profiler's own host cost per op is in that wall time: an upper bound on an unprofiled step's idle."""
    return sum(end - start for start, end in _busy_intervals(events)) / 1e6 / steps


def format_idle(label: str, rows: list[tuple[str, float, int]]) -> list[str]:
    """A markdown table of idle_by_host_op's answer for one implementation."""
    if not rows:
        return [f"GPU idle per step, {label}: no gap of 0.1 ms or more between kernels."]
    lines = [f"GPU idle per step, {label}, by what the host was running:", "",
             "| host op | idle ms | gaps |", "| --- | ---: | ---: |"]
    lines += [f"| `{name[:90].replace('|', '/')}` | {s * 1e3:.2f} | {count} |" for name, s, count in rows]
    return lines


def sum_by_category(events, on_cuda: bool, steps: int) -> dict[str, float]:
    """Seconds per step in each category from the profiler's averaged events: on CUDA the kernels' device time
    (each kernel counted once: CPU ops and named ranges are skipped), on the CPU the ops' self time."""
    totals = dict.fromkeys(COLUMNS, 0.0)
    for event, us in _timed_events(events, on_cuda):
        totals[category(event.key)] += us / 1e6 / steps
    return totals


def amdahl_bound(gemm_fraction: float, speedup: float = 2.0) -> float:
    return 1.0 / (1.0 - gemm_fraction + gemm_fraction / speedup)


def format_profiles(profiles: dict[str, dict[str, float]], step_seconds: dict[str, float] | None = None,
                    timelines: dict[str, tuple[float, float]] | None = None) -> list[str]:
    """A markdown table, ms per step in each category and the GEMMs' share, one row per profiled row. With
    step_seconds (each row's timed step), a column for it; with timelines (each row's profile_step
    (wall, busy)), three more: the profiled step, the time a kernel ran in it, and the GPU's idle time (the
    one less the other: the same steps)."""
    steps, lines_of = step_seconds or {}, timelines or {}
    extra = (" step ms |" if steps else "") + (" profiled step ms | GPU busy ms | GPU idle ms |" if timelines else "")
    lines = ["| implementation | " + " | ".join(f"{c} ms" for c in COLUMNS) + " | total ms | gemm share |" + extra,
             "| --- |" + " ---: |" * (len(COLUMNS) + 2 + (1 if steps else 0) + (3 if timelines else 0))]
    for label, totals in profiles.items():
        total = sum(totals.values())
        share = totals["gemm"] / total if total else 0.0
        line = (f"| {label} | " + " | ".join(f"{totals[c] * 1e3:.1f}" for c in COLUMNS)
                + f" | {total * 1e3:.1f} | {share:.0%} |")
        if steps:
            step = steps.get(label)
            line += f" {step * 1e3:.1f} |" if step else " n/a |"
        if timelines:
            timeline = lines_of.get(label)
            line += (" n/a | n/a | n/a |" if timeline is None else
                     f" {timeline[0] * 1e3:.1f} | {timeline[1] * 1e3:.1f} | {(timeline[0] - timeline[1]) * 1e3:.1f} |")
        lines.append(line)
    return lines


def format_top_kernels(label: str, kernels: list[tuple[str, str, float, int]]) -> list[str]:
    """A markdown table of top_kernels' answer for one implementation (names cut to 90 characters)."""
    lines = [f"Longest kernels per step, {label}:", "", "| kernel | category | ms | calls |",
             "| --- | --- | ---: | ---: |"]
    lines += [f"| `{name[:90].replace('|', '/')}` | {kind} | {s * 1e3:.2f} | {calls} |"
              for name, kind, s, calls in kernels]
    return lines
