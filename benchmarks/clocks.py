"""The GPU's SM clock, board power and temperature while a benchmark row's timed steps run (benchmarks/gpu.py).

Why: on the H200 every compute-bound kernel of the train.compile row (the GEMMs, cuDNN's attention) took
2 to 3% longer than the same kernel, on the same shapes, in the eager row (docs/benchmarks.md). A card at its
power limit lowers its clock, and a step with fewer memory-bound kernels between its GEMMs draws more power.
The clock of each row says whether that is what happened.

How: `nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu -lms 50` runs beside the steps and its
samples are summarised as medians (and the lowest clock). Without nvidia-smi (the CPU smoke, a machine
without the driver's tools) there is nothing to sample and the summary is None.
"""
from __future__ import annotations

import shutil
import statistics
import subprocess

QUERY = "clocks.sm,power.draw,temperature.gpu"
INTERVAL_MS = 50


def parse_samples(text: str) -> list[tuple[float, float, float]]:
    """(MHz, W, C) per line of nvidia-smi's `--format=csv,noheader,nounits` output; lines that do not parse
    (a "[N/A]", a line cut when the process was stopped) are skipped."""
    out = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3:
            continue
        try:
            out.append(tuple(float(f) for f in fields))
        except ValueError:
            continue
    return out


def summarise(samples: list[tuple[float, float, float]]) -> dict | None:
    """Medians of the samples (and the lowest clock); None without any."""
    if not samples:
        return None
    mhz, watts, celsius = zip(*samples)
    return {"sm_mhz": statistics.median(mhz), "min_sm_mhz": min(mhz), "watts": statistics.median(watts),
            "celsius": statistics.median(celsius), "samples": len(samples)}


class ClockSampler:
    """with ClockSampler(gpu_id) as s: ... ; s.summary: summarise() of what nvidia-smi reported meanwhile.
    gpu_id: nvidia-smi's --id (an index, or the card's "GPU-<uuid>", which does not depend on
    CUDA_VISIBLE_DEVICES); None, or no nvidia-smi on PATH: nothing is sampled."""

    def __init__(self, gpu_id: str | None):
        self.gpu_id, self.summary, self._proc = gpu_id, None, None

    def __enter__(self) -> "ClockSampler":
        smi = shutil.which("nvidia-smi")
        if smi and self.gpu_id is not None:
            self._proc = subprocess.Popen([smi, f"--id={self.gpu_id}", f"--query-gpu={QUERY}",
                                           "--format=csv,noheader,nounits", f"-lms={INTERVAL_MS}"],
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            text, _ = self._proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            text, _ = self._proc.communicate()
        self.summary = summarise(parse_samples(text))


def gpu_id(device) -> str | None:
    """nvidia-smi's id of a torch CUDA device: "GPU-<uuid>" (None off CUDA)."""
    import torch
    if device.type != "cuda":
        return None
    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


def format_clocks(rows: list[dict], pairs: list[tuple[str, str]] = ()) -> list[str]:
    """A table of each row's clocks during its timed steps (rows without them left out; [] when none has), then
    the ratio of the median SM clocks for each (row, other row) of pairs that both have them."""
    timed = [r for r in rows if r.get("clocks")]
    if not timed:
        return []
    mhz = {r["implementation"]: r["clocks"]["sm_mhz"] for r in timed}
    ratios = [f"- SM clock, {top} / {bottom}: {mhz[top] / mhz[bottom]:.3f}" for top, bottom in pairs
              if top in mhz and bottom in mhz]
    lines = [f"Clocks during the timed steps (nvidia-smi every {INTERVAL_MS} ms, medians):", "",
             "| implementation | SM MHz | lowest SM MHz | board W | GPU C | samples |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in timed:
        c = r["clocks"]
        lines.append(f"| {r['implementation']} | {c['sm_mhz']:,.0f} | {c['min_sm_mhz']:,.0f} | {c['watts']:.0f} | "
                     f"{c['celsius']:.0f} | {c['samples']} |")
    return lines + (["", *ratios] if ratios else [])
