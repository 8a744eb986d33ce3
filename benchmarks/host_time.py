"""Host time of a training step: what the GPU waits for when the host is behind.

    python benchmarks/host_time.py [--steps 40] [--threads 1]

On a GPU the host only queues work, and a step's time is the GPU's unless the GPU runs dry: after the host
reads a value back (the GPU drains first), the GPU idles until the host has queued the next kernel. This
runs gpu.py's llama 1.0B layout (16 layers, GQA 16/8, untied head) at tiny widths on the CPU, where the
arithmetic is negligible and a step's time is the host's: the Python, dispatch and launch work that a GPU
run hides behind its kernels unless a read exposes it. Rows, timed step by step in turn (medians):
- the pipetrain Trainer as it runs on the CPU (foreach AdamW: the norm is read before the update);
- the Trainer on the path it takes on a GPU (fused AdamW: Optimizer.clip_and_step, nothing read before the
  update is queued), run here by adding "cpu" to pipetrain.optim.adamw.FUSED_DEVICES;
- gpu.py's plain loop (the same model, F.cross_entropy, clip_grad_norm_, fused AdamW).
Each row also gives its reads of floating-point values to the host before the update is queued (each one
drains a GPU), counted by a dispatch probe, and the host time of the gradient norm alone. A checkout
without FUSED_DEVICES (before the device path) runs the first row twice; its figures say so.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import pipetrain.optim.adamw as adamw  # noqa: E402
from pipetrain.build import build_trainer  # noqa: E402
from pipetrain.config import ModelConfig, load_recipe  # noqa: E402
from pipetrain.data import Loader, PackedData  # noqa: E402
from pipetrain.models import build, materialize  # noqa: E402

# gpu.py's LLAMA_1B with every width cut down: the same modules, parameters and launches per step
LAYOUT = dict(family="llama", vocab_size=256, d_model=64, n_layers=16, n_heads=16, n_kv_heads=8, ffn_hidden=128,
              max_seq_len=16, tie_embeddings=False)
SEQ, BATCH = 16, 2
UPDATE_OPS = ("_fused_adamw_", "_foreach_lerp_")  # the first op of AdamW's update, fused or foreach


class ReadProbe(TorchDispatchMode):
    """Counts reads of floating-point tensors to the host (item(), float()) before the optimizer's update."""

    def __init__(self):
        super().__init__()
        self.reads, self.updated = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in UPDATE_OPS:
            self.updated = True
        elif name == "_local_scalar_dense" and args[0].dtype.is_floating_point and not self.updated:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def trainer_row(out: str, device_path: bool):
    """(step function, gradient-norm function) of a Trainer on the CPU; device_path: fused AdamW."""
    keys = [f"model.{k}={v}" for k, v in LAYOUT.items()] + [
        f"train.seq_len={SEQ}", f"train.global_batch={BATCH}", "train.steps=100000", "train.precision=fp32",
        "train.warmup_steps=1", "parallel.microbatches=1", f"run.output_dir={out}", "run.progress=false",
        "run.eval_every=0", "run.sample_tokens=0", "checkpoint.every=0"]
    recipe = load_recipe(os.path.join(ROOT, "recipes", "tiny.yaml"), keys)
    os.makedirs(out, exist_ok=True)
    num = BATCH * (SEQ + 1) * 64
    tokens = np.random.default_rng(0).integers(0, LAYOUT["vocab_size"], num).astype(np.int32)
    data = PackedData(tokens, np.ones(num, dtype=bool), SEQ, 0.0, 0)
    saved = getattr(adamw, "FUSED_DEVICES", None)
    if device_path and saved is not None:
        adamw.FUSED_DEVICES = ("cuda", "cpu")
    try:
        trainer = build_trainer(recipe, loader=Loader(data, BATCH, 0, 1))
    finally:
        if saved is not None:
            adamw.FUSED_DEVICES = saved
    return trainer.train_step, lambda: trainer.optimizer.clip_grad_norm(0.0)


def plain_row():
    cfg = ModelConfig(**LAYOUT)
    net = materialize(build(cfg), cfg, 0, "cpu")
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    batch = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = batch[:, :-1], batch[:, 1:]

    def step():
        loss = F.cross_entropy(net(inputs).float().flatten(0, 1), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    def norm():
        grads = [p.grad for p in params if p.grad is not None]
        return float(torch.stack(torch._foreach_norm(grads)).norm())
    return step, norm


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tmp = tempfile.mkdtemp(prefix="pipetrain-host-time-")
    device_path = hasattr(adamw, "FUSED_DEVICES")
    rows = {"pipetrain Trainer, CPU path (foreach AdamW)": trainer_row(os.path.join(tmp, "host"), False),
            "pipetrain Trainer, GPU path (fused AdamW)" + ("" if device_path else ": not in this checkout"):
                trainer_row(os.path.join(tmp, "device"), True),
            "plain loop (fused AdamW, clip_grad_norm_)": plain_row()}
    times = {label: [] for label in rows}
    norm_times = {label: [] for label in rows}
    reads = {}
    for label, (step, _) in rows.items():
        for _ in range(3):  # warm-up: the optimizer state, the allocator, lazy imports
            step()
        probe = ReadProbe()
        with probe:
            step()
        reads[label] = probe.reads
    for _ in range(args.steps):  # in turn, so machine noise hits every row alike
        for label, (step, norm) in rows.items():
            t0 = time.perf_counter()
            step()
            times[label].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            norm()
            norm_times[label].append(time.perf_counter() - t0)
    print(f"host time of a step, llama 1.0B layout at tiny widths (d {LAYOUT['d_model']}, {LAYOUT['n_layers']} "
          f"layers), {BATCH}x{SEQ} tokens, CPU fp32, {args.threads} thread(s), medians of {args.steps} steps\n")
    print("| row | step ms | gradient norm ms | float reads before the update |")
    print("| --- | ---: | ---: | ---: |")
    for label in rows:
        print(f"| {label} | {statistics.median(times[label]) * 1e3:.2f} | "
              f"{statistics.median(norm_times[label]) * 1e3:.2f} | {reads[label]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
