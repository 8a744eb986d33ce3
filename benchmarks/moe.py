"""Mixture-of-experts benchmark: grouped expert compute against loops over experts, and a tiny MoE's
training throughput and memory beside the dense model of equal active parameters (one process).

    python benchmarks/moe.py [experts] [train] [--steps 6] [--threads 2]

experts: one MoE layer's experts, forward + backward, median of --reps: (a) pipetrain's path
  (MoE.dispatch_compute_combine: one stable sort by expert, grouped_swiglu over contiguous rows,
  index_add back), (b) the Hugging Face loop (per expert, torch.where over the routing mask, gather,
  compute, index_add: transformers' MixtralExperts), (c) grouped_swiglu_loop (the reference) against
  grouped_swiglu off CUDA (the op pipetrain::grouped_linear, which compiled blocks hold too) and against
  per-expert indexing gate[e] (what the unbind in the loop avoids). On CUDA also torch._grouped_mm (bf16)
  against the loop.
train: pipetrain.build.build_trainer on synthetic tokens for --steps steps (first step dropped): the
  MoE (8 experts, top 2, expert width F/2) against the llama of the same active MLP width F; tokens/s
  (median), total and active parameters, the planner's predicted peak (pipetrain.plan.memory.run_memory)
  and the process's peak RSS growth over training (VmHWM reset through /proc/self/clear_refs).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

from common import median_seconds, proc_status_bytes  # noqa: E402  (puts the repository root on sys.path)
from pipetrain.build import build_trainer  # noqa: E402
from pipetrain.config import ModelConfig, ParallelConfig, Recipe, RunConfig, TrainConfig  # noqa: E402
from pipetrain.data import Loader, PackedData  # noqa: E402
from pipetrain.kernels import swiglu  # noqa: E402
from pipetrain.models import count_params  # noqa: E402
from pipetrain.models.moe import MoE, grouped_swiglu, grouped_swiglu_loop  # noqa: E402
from pipetrain.plan.memory import run_memory  # noqa: E402

MOE = ModelConfig(family="mixtral", vocab_size=8192, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4,
                  max_seq_len=256, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=352,
                  router_aux_loss_coef=0.01)
DENSE = ModelConfig(family="llama", vocab_size=8192, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4,
                    max_seq_len=256, ffn_hidden=704)  # the MoE's active MLP width: 2 x 352


def hf_loop(moe: MoE, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
    """transformers' MixtralExperts.forward: per expert, the tokens routed to it by torch.where."""
    x = x.reshape(-1, x.shape[-1])
    out = torch.zeros_like(x)
    e = moe.experts
    for i in range(moe.num_experts):
        token, slot = torch.where(topk_idx == i)
        if token.numel():
            xe = x[token]
            y = F.linear(swiglu(F.linear(xe, e.gate[i]), F.linear(xe, e.up[i])), e.down[i])
            out.index_add_(0, token, y * topk_w[token, slot, None])
    return out


def indexed_loop(x_sorted, counts, gate, up, down):
    """grouped_swiglu_loop with gate[e] per expert instead of one unbind (each index's backward writes a
    zero-filled full-size gradient)."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            xe = x_sorted[start:start + n]
            outs.append(F.linear(swiglu(F.linear(xe, gate[e]), F.linear(xe, up[e])), down[e]))
            start += n
    return torch.cat(outs)


def bench_experts(tokens: int, reps: int, device: str) -> list[dict]:
    torch.manual_seed(0)
    moe = MoE(MOE).to(device)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.05)
    x = torch.randn(1, tokens, MOE.d_model, device=device, requires_grad=True)
    idx, w, _ = moe.route(x)
    idx, w = idx.detach(), w.detach()

    def step(fn, autocast: bool = False):
        def run():
            moe.zero_grad(set_to_none=True)
            with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                out = fn()
            out.float().sum().backward()
            if device == "cuda":  # the GPU's time, not the launches': every row waits for its kernels
                torch.cuda.synchronize()
        return run

    # on CUDA under bf16 autocast, as training runs it: the grouped GEMM needs bf16 (models/moe.py)
    rows = [{"what": "dispatch_compute_combine (sort + grouped)" + (", bf16 autocast" if device == "cuda" else ""),
             "s": median_seconds(step(lambda: moe.dispatch_compute_combine(x, idx, w), device == "cuda"), reps)},
            {"what": "HF loop (where per expert)", "s": median_seconds(step(lambda: hf_loop(moe, x, idx, w)), reps)}]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=MOE.num_experts)
    xs = x.reshape(-1, MOE.d_model)[order // MOE.num_experts_per_tok].detach().requires_grad_()
    e = moe.experts
    rows.append({"what": "grouped_swiglu_loop (unbind)", "s": median_seconds(
        step(lambda: grouped_swiglu_loop(xs, counts.tolist(), e.gate, e.up, e.down)), reps)})
    if device != "cuda":  # off CUDA grouped_swiglu is the op pipetrain::grouped_linear: the loop as one op
        rows.append({"what": "grouped_swiglu (pipetrain::grouped_linear)", "s": median_seconds(
            step(lambda: grouped_swiglu(xs, counts, e.gate, e.up, e.down)), reps)})
    rows.append({"what": "loop with gate[e] indexing", "s": median_seconds(
        step(lambda: indexed_loop(xs, counts.tolist(), e.gate, e.up, e.down)), reps)})
    if device == "cuda":  # the grouped GEMM needs bf16
        xb = xs.detach().bfloat16().requires_grad_()
        gb, ub, db = (t.detach().bfloat16().requires_grad_() for t in (e.gate, e.up, e.down))
        rows.append({"what": "grouped_swiglu bf16 (torch._grouped_mm)", "s": median_seconds(
            step(lambda: grouped_swiglu(xb, counts, gb, ub, db)), reps)})
        rows.append({"what": "grouped_swiglu_loop bf16", "s": median_seconds(
            step(lambda: grouped_swiglu_loop(xb, counts.tolist(), gb, ub, db)), reps)})
        torch.cuda.synchronize()
    for r in rows:
        r.update(tokens=tokens, device=device)
    return rows


def _reset_peak_rss() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_status_bytes("VmRSS")


def bench_train(cfg: ModelConfig, steps: int) -> dict:
    seq_len, batch = 256, 8
    recipe = Recipe(model=cfg, parallel=ParallelConfig(),
                    train=TrainConfig(steps=steps, global_batch=batch, seq_len=seq_len, lr=1e-3, warmup_steps=1),
                    run=RunConfig(output_dir=tempfile.mkdtemp(prefix="moe-bench-"), progress=False))
    rng = np.random.default_rng(0)
    num = 64 * (seq_len + 1)
    data = PackedData(rng.integers(0, cfg.vocab_size, num).astype(np.int32), np.ones(num, dtype=bool),
                      seq_len, 0.0, 2)
    trainer = build_trainer(recipe, loader=Loader(data, batch, 0, 1))
    trainer.train_step()  # warm-up, dropped
    before = _reset_peak_rss()
    rates = [trainer.train_step()["tokens_per_sec"] for _ in range(steps - 1)]
    return {"model": cfg.family, "params": count_params(trainer.model),
            "active_params": count_params(trainer.model, active=True),
            "tokens_per_sec": statistics.median(rates),
            "predicted_peak_gib": max(m.total for m in run_memory(recipe, 1)) / 2**30,
            "rss_growth_gib": (proc_status_bytes("VmHWM") - before) / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", nargs="*", default=["experts", "train"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if "experts" in args.what:
        for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
            for r in bench_experts(2048, args.reps, device):
                print(json.dumps(r), flush=True)
    if "train" in args.what:
        for cfg in (MOE, DENSE):
            print(json.dumps(bench_train(dataclasses.replace(cfg), args.steps)), flush=True)


if __name__ == "__main__":
    main()
