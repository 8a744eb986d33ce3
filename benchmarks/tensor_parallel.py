"""Tensor parallelism on CPU with gloo: memory, step time and communication, against PyTorch DTensor.

For tp in 1, 2, 4 it spawns tp gloo processes (one thread each) and measures, on a fixed batch of a
small llama (D 256, 4 layers, 8 heads / 4 kv heads, V 8192):
- per-rank parameter bytes;
- step time: forward + vocab-parallel loss + backward + tp-partial grad sync + AdamW step on a fixed
  batch; median over --steps rounds after a warm-up step. Each round runs every implementation in turn
  (pipetrain and DTensor, each with and without sp), each step starting at a barrier, timed on rank 0, so the
  shared machine's noise affects them alike;
- communication per step per rank, counted by a TorchDispatchMode that sees every collective (c10d
  ops from pipetrain.parallel.mesh.comm and the loss, functional collectives from DTensor). A collective's
  "payload" is its largest tensor (the full tensor being reduced or gathered); "wire" is what a ring
  algorithm sends per rank: 2(n-1)/n of the payload for all-reduce, (n-1)/n for all-gather and
  reduce-scatter. The pipetrain payload is compared with the Megatron count:
    no sp: per layer 2 forward + 2 backward all-reduces of B*T*D, plus the embedding's forward and the
           head input's backward all-reduce (B*T*D each) and the loss's 3 all-reduces of B*T floats;
    sp:    each all-reduce becomes an all-gather plus a reduce-scatter of the same B*T*D payload (each
           half an all-reduce's wire bytes, so the same total), plus the head input's all-gather /
           reduce-scatter and the norms' tp-partial gradient all-reduce.
- the same model and layout under DTensor (ColwiseParallel / RowwiseParallel via parallelize_module
  on the tp dim of dims.mesh, SequenceParallel on the norms for sp, loss_parallel for the
  vocab-sharded loss); the ratio is pipetrain step time / DTensor step time, and the first-step losses of
  all four are printed to show they compute the same thing.

Usage: python benchmarks/tensor_parallel.py [--steps 10] [--tp 1 2 4] [--batch 4] [--seq 128]
Shapes: B batch, T time, D model, L layers, V vocab.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import run_ranks
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               loss_parallel, parallelize_module)
from torch.utils._python_dispatch import TorchDispatchMode

from pipetrain.config import ModelConfig
from pipetrain.models import build, materialize
from pipetrain.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.tensor.layers import apply_tensor_parallel, sync_tp_partial_grads

CFG = ModelConfig(family="llama", vocab_size=8192, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4,
                  ffn_hidden=704, max_seq_len=256)
SEED = 0


class CommCounter(TorchDispatchMode):
    """Counts collectives seen by the dispatcher: {op: [calls, payload bytes, wire bytes]}."""

    def __init__(self, world: int):
        super().__init__()
        self.world = world
        self.ops = defaultdict(lambda: [0, 0, 0.0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t.__name__ == "DTensor" for t in types):
            return NotImplemented  # let DTensor lower the op to plain ops and collectives, then count those
        out = func(*args, **(kwargs or {}))
        name = str(func._overloadpacket)
        if "c10d" in name and name.rsplit(".", 1)[-1] in _COLLECTIVES:
            tensors = [t for t in _flatten((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            payload = max((t.numel() * t.element_size() for t in tensors), default=0)
            n = self.world
            factor = 2 * (n - 1) / n if "reduce" in name and "scatter" not in name else (n - 1) / n
            entry = self.ops[name.split(".")[-1]]
            entry[0] += 1
            entry[1] += payload
            entry[2] += payload * factor
        return out


# c10d ops (torch.distributed calls) and functional collectives (DTensor); not waits or autograd wrappers.
_COLLECTIVES = {"allreduce_", "_allgather_base_", "_reduce_scatter_base_", "allgather_", "reduce_scatter_",
                "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"}


def _flatten(x):
    if isinstance(x, (list, tuple)):
        for item in x:
            yield from _flatten(item)
    elif isinstance(x, dict):
        for item in x.values():
            yield from _flatten(item)
    else:
        yield x


def megatron_payload_bytes(cfg: ModelConfig, batch: int, seq: int, sp: bool) -> int:
    """Expected collective payload per step and rank (fp32), see the module docstring."""
    btd, bt = batch * seq * cfg.d_model, batch * seq
    if not sp:
        return 4 * ((4 * cfg.n_layers + 2) * btd + 3 * bt)
    # Each all-reduce becomes an all-gather and a reduce-scatter with the same payload (so twice the
    # payload, the same ring wire bytes), plus the head's input gather and the RMSNorm weights' sync.
    norm_params = (2 * cfg.n_layers + 1) * cfg.d_model
    return 4 * ((8 * cfg.n_layers + 4) * btd + 3 * bt + norm_params)


def _batch(batch: int, seq: int):
    gen = torch.Generator().manual_seed(1)
    return (torch.randint(0, CFG.vocab_size, (batch, seq), generator=gen),
            torch.randint(0, CFG.vocab_size, (batch, seq), generator=gen))


def _pipetrain(dims: ParallelDims, tokens, targets, sp: bool):
    """(one training step, per-rank parameter bytes) for pipetrain's tensor parallelism."""
    model = build(CFG)
    apply_tensor_parallel(model, dims, sequence_parallel=sp)
    materialize(model, CFG, SEED, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = vocab_parallel_cross_entropy(model(tokens), targets, tp_group=dims.tp_group)
        loss.backward()
        sync_tp_partial_grads(model, dims)
        opt.step()
        return loss.item()

    return step, sum(p.numel() * p.element_size() for p in model.parameters())


def _dtensor(dims: ParallelDims, tokens, targets, sp: bool):
    """(one training step, per-rank parameter bytes) for the same layout under DTensor."""
    model = build(CFG)
    materialize(model, CFG, SEED, "cpu")
    mesh = dims.mesh["tp"]  # the tp dim of dims' device mesh: dims stays the only creator of groups
    stream = Shard(1) if sp else Replicate()  # layout of the residual stream between blocks
    plan = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
            "head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)}
    if sp:
        plan["norm"] = SequenceParallel()
    for i in model.layers:
        # One region entry per block as in pipetrain: the block input becomes a replicated DTensor,
        # so the partial input gradients of wq/wk/wv (gate/up) are summed once, not per linear.
        for block in ("attn", "mlp"):
            plan[f"layers.{i}.{block}"] = PrepareModuleInput(input_layouts=(stream,),
                                                             desired_input_layouts=(Replicate(),))
            if sp:
                plan[f"layers.{i}.{block}_norm"] = SequenceParallel()
        for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.gate", "mlp.up"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.wo", "mlp.down"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel(output_layouts=stream)
    parallelize_module(model, mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(tokens)  # DTensor (B, T, V) sharded on V
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
        opt.step()
        return float(loss.full_tensor())

    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return step, sum(p.numel() * p.element_size() for p in local)


def _measure(steps_by_name: dict, num_steps: int, tp: int) -> dict:
    """Communication of one counted step each, then num_steps timed rounds that run every
    implementation in turn, so the shared machine's noise hits all of them alike."""
    out = {}
    for name, (step, param_bytes) in steps_by_name.items():
        first_loss = step()  # warm-up (allocations, the reduce_scatter probe); same weights and batch
        counter = CommCounter(tp)
        with counter:
            step()
        out[name] = {"param_bytes": param_bytes, "comm": dict(counter.ops), "times": [], "loss": first_loss}
    for _ in range(num_steps):
        for name, (step, _) in steps_by_name.items():
            dist.barrier()
            t0 = time.perf_counter()
            step()
            out[name]["times"].append(time.perf_counter() - t0)
    return out


def _tp_worker(rank: int, world_size: int, args) -> dict:
    dims = ParallelDims.from_degrees(tp=world_size)
    tokens, targets = _batch(args.batch, args.seq)
    impls = {"pipetrain": _pipetrain(dims, tokens, targets, sp=False)}
    if world_size > 1:
        impls["pipetrain_sp"] = _pipetrain(dims, tokens, targets, sp=True)
        impls["dtensor"] = _dtensor(dims, tokens, targets, sp=False)
        impls["dtensor_sp"] = _dtensor(dims, tokens, targets, sp=True)
    return _measure(impls, args.steps, world_size)


def _row(tp: int, name: str, r: dict, ratio: str, expected: int | None) -> str:
    payload = sum(v[1] for v in r["comm"].values())
    wire = sum(v[2] for v in r["comm"].values())
    calls = sum(v[0] for v in r["comm"].values())
    exp = "-" if expected is None else f"{expected / 2**20:.2f}"
    return (f"| {tp} | {name} | {r['param_bytes'] / 2**20:.1f} | {statistics.median(r['times']) * 1e3:.0f} | "
            f"{calls} | {payload / 2**20:.2f} | {exp} | {wire / 2**20:.2f} | {ratio} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    print(f"model {CFG.family} D={CFG.d_model} L={CFG.n_layers} H={CFG.n_heads}/{CFG.kv_heads} V={CFG.vocab_size}; "
          f"batch {args.batch}x{args.seq}; {args.steps} timed steps; gloo, 1 thread per rank")
    print("| tp | impl | params MiB/rank | step ms (median) | collectives/step | payload MiB/step | "
          "Megatron payload MiB | ring wire MiB/rank | pipetrain/DTensor time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tp in args.tp:
        res = run_ranks(tp, _tp_worker, args)
        if tp == 1:
            print(_row(tp, "pipetrain", res["pipetrain"], "-", 0))
            continue
        for sp in (False, True):
            suffix = "_sp" if sp else ""
            dt = statistics.median(res["dtensor" + suffix]["times"])
            ratio = f"{statistics.median(res['pipetrain' + suffix]['times']) / dt:.2f}"
            label = " +sp" if sp else ""
            print(_row(tp, "pipetrain" + label, res["pipetrain" + suffix], ratio,
                       megatron_payload_bytes(CFG, args.batch, args.seq, sp)))
            print(_row(tp, "DTensor" + label, res["dtensor" + suffix], "1.00", None))
        losses = {name: round(r["loss"], 5) for name, r in res.items()}
        print(f"<!-- tp {tp} first-step loss (equal = same mathematics): {losses} -->")
        ops = {k: v[0] for k, v in res["pipetrain"]["comm"].items()}
        print(f"<!-- tp {tp} collectives per step: pipetrain {ops}; "
              f"sp {({k: v[0] for k, v in res['pipetrain_sp']['comm'].items()})}; "
              f"DTensor {({k: v[0] for k, v in res['dtensor']['comm'].items()})}; "
              f"DTensor sp {({k: v[0] for k, v in res['dtensor_sp']['comm'].items()})} -->")


if __name__ == "__main__":
    main()
