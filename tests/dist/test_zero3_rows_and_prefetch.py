"""ZeRO-3 cases tests/dist/test_zero3.py leaves out (found by a mutation audit):

- rows that do not split evenly over dp. Every test_zero3 model has row counts divisible by dp, and then each
  member of a unit starts at the same offset in every rank's part of the gather buffer, so code that places a
  rank's rows at another rank's offsets gives the same numbers. A vocabulary of 63 at dp 2 splits the embedding
  32 / 31 rows, which moves the position embedding after it in the embedding unit by one row on rank 1.
- the prefetch: with the gathers counted per pass (test_zero3's unit_gathers), a gatherer that never prefetches
  gathers the same units the same number of times and gives the same losses, so nothing there sees the overlap
  the module promises (each unit's all-gather starts while its neighbour computes). The timeline
  (UnitGatherer.events, benchmarks/zero3.py --timeline) shows it: a prefetch is logged just before the
  neighbour's compute starts.
"""
from __future__ import annotations

import dataclasses
import os

import torch

from pipetrain.models import param_layout
from pipetrain.parallel.mesh.dims import ParallelDims
from tests.dist.test_zero3 import BUCKET_BYTES, COMMON, LLAMA4
from tests.harness import EXACT_FP32, rank_results
from tests.unit.common import GPT2, build_trainer

STEPS = 3
UNEVEN = dataclasses.replace(GPT2, vocab_size=63)  # tied: embedding rows 32 / 31 at dp 2, position embedding after it
SEQ = UNEVEN.max_seq_len  # every position row is read: rank 1's rows of the position embedding reach the loss


def _uneven_worker(rank, world_size, out):
    own, shared = os.path.join(out, f"rank{rank}"), os.path.join(out, "zero3")
    os.makedirs(own, exist_ok=True)
    os.makedirs(shared, exist_ok=True)
    ref = build_trainer(UNEVEN, own, ParallelDims(), steps=STEPS, seq_len=SEQ, **COMMON)
    want = [(r["loss"], r["grad_norm"]) for r in (ref.train_step() for _ in range(STEPS))]
    z3 = build_trainer(UNEVEN, shared, ParallelDims.from_degrees(), zero=3, bucket_bytes=BUCKET_BYTES, steps=STEPS,
                       seq_len=SEQ, **COMMON)
    opt = z3.optimizer
    rows = {s.name: s.rows for s in opt.shards}
    assert rows["embed.weight"] == ((0, 32), (32, 63)), rows["embed.weight"]  # the case this test is about
    got = [(r["loss"], r["grad_norm"]) for r in (z3.train_step() for _ in range(STEPS))]
    full, ref_params = opt.gatherer.full_params(), dict(ref.model.named_parameters())
    diff = {n: float((full[n] - ref_params[n].detach()[sl]).abs().max())
            for n, (_, sl) in param_layout(z3.model).items()}
    return got, want, diff


def test_zero3_with_rows_that_do_not_split_evenly_over_dp_matches_the_single_process(tmp_path):
    for rank, (got, want, diff) in enumerate(rank_results(2, _uneven_worker, str(tmp_path))):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **EXACT_FP32,
                                   msg=lambda m: f"rank {rank} (loss, grad norm) per step: {m}")
        assert max(diff.values()) < 1e-4, (rank, {n: d for n, d in diff.items() if d >= 1e-4})


def _prefetch_worker(rank, world_size, out):
    os.makedirs(out, exist_ok=True)
    trainer = build_trainer(LLAMA4, out, ParallelDims.from_degrees(), zero=3, bucket_bytes=BUCKET_BYTES, steps=2,
                            **COMMON)
    trainer.train_step()  # the first step learns which prefetches go unused (none at pp 1)
    gatherer = trainer.optimizer.gatherer
    gatherer.events = []
    trainer.train_step()
    seq = [(event, k) for _, event, k in gatherer.events if event != "done"]
    pairs = set(zip(seq, seq[1:]))
    n = len(gatherer.units)
    # a prefetch: unit k's gather logged right before unit k - 1's forward (k + 1's backward) starts computing
    forward = [k for k in range(1, n) if (("gather forward", k), ("forward", k - 1)) in pairs]
    backward = [k for k in range(1, n - 1) if (("gather backward", k), ("backward", k + 1)) in pairs]
    return n, forward, backward


def test_zero3_starts_each_units_gather_while_its_neighbour_computes(tmp_path):
    """Every unit after the embedding is prefetched in forward by the one before it, and every block before the
    last is prefetched in backward by the one after it (the embedding's backward reads no weight)."""
    for rank, (n, forward, backward) in enumerate(rank_results(2, _prefetch_worker, str(tmp_path))):
        assert forward == list(range(1, n)), (rank, n, forward)
        assert backward == list(range(1, n - 1)), (rank, n, backward)
