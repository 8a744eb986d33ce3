"""metrics.jsonl's tokens_per_sec and mfu on 2 data-parallel ranks, against the contract in DESIGN.md.

tokens_per_sec is the step's global tokens (train.global_batch x seq_len, over every rank) per second; mfu the
achieved matmul FLOP/s, models.flops_per_token x those tokens / the step's seconds, over the peak of all the
world's devices (run.peak_tflops x world size). Mutants killed (each survived the default suite, whose MFU checks
ran on one rank or none):

  M01  mfu not divided by the world size (2x too high at dp 2)
  M02  tokens_per_sec reported per rank (half the global rate at dp 2)
"""
import json
import os

from pipetrain.config import ParallelConfig
from pipetrain.models import flops_per_token
from pipetrain.parallel.mesh.dims import ParallelDims
from tests.dist.common import replica_trainer
from tests.harness import run_ranks
from tests.unit.common import LLAMA

PEAK = 0.5  # TFLOP/s per device


def _two_steps(rank, world, out):
    dims = ParallelDims.init(ParallelConfig())  # dp 2
    trainer = replica_trainer(out, dims, steps=2)
    trainer.peak = PEAK
    records = [trainer.train_step() for _ in range(2)]
    trainer.logger.close()
    if rank == 0:
        with open(os.path.join(out, "records.json"), "w") as f:
            json.dump(records, f)


def test_mfu_and_tokens_per_sec_count_every_rank(tmp_path):
    run_ranks(2, _two_steps, str(tmp_path), timeout_s=60)
    records = json.load(open(tmp_path / "records.json"))
    tokens = 8 * 16  # replica_trainer: global batch 8 of 16 tokens, over both ranks
    for r in records:
        assert abs(r["tokens_per_sec"] / (tokens / r["step_time_s"]) - 1) < 1e-9
        mfu = flops_per_token(LLAMA, 16) * tokens / r["step_time_s"] / (PEAK * 1e12 * 2)
        assert abs(r["mfu"] / mfu - 1) < 1e-9, (r["mfu"], mfu)
