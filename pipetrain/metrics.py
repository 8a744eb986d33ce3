"""Step metrics: metrics.jsonl (global rank 0), a progress bar, TensorBoard when installed, MFU.

metrics.jsonl is a contract (DESIGN.md): each optimizer step writes step, loss, lr, grad_norm,
tokens (cumulative), tokens_per_sec, step_time_s, peak_mem_bytes, and mfu when a peak FLOP rate is
known; evaluations write step, eval_loss, eval_tokens.
"""
from __future__ import annotations

import json
import os
import resource
import sys

import torch

# Dense bf16 tensor-core peaks (TFLOP/s per device, no sparsity) from the vendors' data sheets.
GPU_PEAK_TFLOPS = {
    "H200": 989.0, "H100 SXM": 989.0, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.0,
    "A100": 312.0, "A10G": 70.0, "A10": 125.0, "L40S": 362.0, "L4": 121.0, "V100": 125.0, "B200": 2250.0,
}


def peak_tflops(device: torch.device, configured: float | None) -> float | None:
    """Peak TFLOP/s of one device: run.peak_tflops, else the GPU table, else None (no MFU)."""
    if configured:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_PEAK_TFLOPS.items():  # longest names first in the table order
            if key in name:
                return value
    return None


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory on CUDA; peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


class MetricsLogger:
    """Writes metrics on global rank 0 only; every other rank's calls are no-ops."""

    def __init__(self, output_dir: str, enabled: bool, total_steps: int, progress: bool, start_step: int = 0):
        self.enabled = enabled
        self.file = open(os.path.join(output_dir, "metrics.jsonl"), "a") if enabled else None
        self.tb = None
        self.bar = None
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        except ImportError:  # TensorBoard is optional
            self.tb = None
        if progress and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        step = record["step"]
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, step)
        if "loss" in record:
            if self.bar is not None:
                self.bar.update(step - self.bar.n)
                self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                                     tok_s=f"{record['tokens_per_sec']:.0f}")
        self.print_line(record)

    def print_line(self, record: dict) -> None:
        if "loss" in record and self.bar is None:
            extra = f" | mfu {record['mfu']:.1%}" if "mfu" in record else ""
            print(f"step {record['step']:>6} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
                  f"grad norm {record['grad_norm']:.3f} | {record['tokens_per_sec']:.0f} tok/s{extra}", flush=True)
        elif "eval_loss" in record:
            self.write(f"eval at step {record['step']}: loss {record['eval_loss']:.4f} "
                       f"over {record['eval_tokens']} tokens")

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.file is not None:
            self.file.close()
