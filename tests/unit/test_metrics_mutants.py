"""metrics.jsonl's throughput fields and the console's resume-aware figures, against numbers derived by hand.

DESIGN.md's contract: tokens is cumulative, tokens_per_sec the step's global tokens over its seconds, mfu the
achieved matmul FLOP/s (models.flops_per_token x tokens / seconds) over the peak of all ranks. A resumed run's
console counts only the steps it ran. Mutants these tests kill (each survived the default suite):

  M03  tokens written as the step's tokens, not the running total
  M05  the summary's token count and steps counting from step 0 on a resumed run
  M06  the ETA counting the steps before the resume as done in this process's time
  M07  the summary's steady-state range starting at step 3 on a resumed run
  M11  peak_mem_bytes on the CPU written in KiB (ru_maxrss's unit), not bytes
  F03  flops_per_token ignoring a sliding window (T/2 keys a query, not W)
  F05  gpt2's MLP counted with 3 matrices, not 2
  F06  the projections counted as 3 Hq + Hkv heads (o with the kv heads' width), not 2 Hq + 2 Hkv
  (M01, MFU not divided by the world size, is killed by tests/dist/test_metrics_mutants.py)
"""
from __future__ import annotations

import json
import time

import pytest

from pipetrain.metrics import MetricsLogger
from pipetrain.models import flops_per_token
from tests.unit.common import LLAMA, build_trainer

GB, T = 8, 16


def test_a_step_s_record_holds_the_cumulative_tokens_its_rate_and_its_mfu(tmp_path):
    trainer = build_trainer(LLAMA, str(tmp_path), steps=3, global_batch=GB, seq_len=T)
    trainer.peak = 0.5  # TFLOP/s: any figure, the CPU has none in the table
    records = [trainer.train_step() for _ in range(2)]
    assert [r["tokens"] for r in records] == [GB * T, 2 * GB * T]
    for r in records:
        assert r["tokens_per_sec"] == pytest.approx(GB * T / r["step_time_s"], rel=1e-9)
        expected = flops_per_token(LLAMA, T) * GB * T / r["step_time_s"] / 0.5e12
        assert r["mfu"] == pytest.approx(expected, rel=1e-9)
    trainer.logger.close()


def _record(step: int, rate: float) -> dict:
    return {"step": step, "loss": 2.0, "lr": 1e-3, "grad_norm": 0.5, "tokens": step * 256, "tokens_per_sec": rate,
            "step_time_s": 0.256, "peak_mem_bytes": 1}


def test_a_resumed_run_s_summary_counts_only_the_steps_it_ran(tmp_path, capsys):
    """Resumed at step 10 of 16, 6 steps of 256 tokens: 1,536 tokens; the steady state leaves out this
    process's first 2 steps (11, 12) and takes the median of steps 13-16."""
    logger = MetricsLogger(str(tmp_path), enabled=True, total_steps=16, progress=False, start_step=10,
                           log_every=100, tokens_per_step=256)
    rates = [10.0, 20.0, 1000.0, 1100.0, 1200.0, 1300.0]
    for step, rate in zip(range(11, 17), rates):
        logger.log(_record(step, rate))
    logger.summary()
    logger.close()
    done = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("done: ")]
    assert len(done) == 1
    assert done[0].startswith("done: 6 steps (11-16), 1,536 tokens in "), done[0]
    assert "steady state 1,150 tok/s (median of steps 13-16)" in done[0], done[0]
    assert len([json.loads(x) for x in open(tmp_path / "metrics.jsonl")]) == 6


def test_a_resumed_run_s_eta_extrapolates_from_the_steps_this_process_ran(tmp_path, capsys):
    """Resumed at step 90 of 100: after 5 steps in E seconds, 5 remain, so the ETA is about E (not E / 95 x 5)."""
    logger = MetricsLogger(str(tmp_path), enabled=True, total_steps=100, progress=False, start_step=90, log_every=5)
    logger.started = time.perf_counter() - 100.0  # as if the 5 steps took 100 s
    for step in range(91, 96):
        logger.log(_record(step, 1000.0))
    logger.close()
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")][-1]
    assert " 95/100 " in line and "elapsed 1m40s" in line, line
    eta = line.rsplit("eta ", 1)[1]
    assert eta in ("1m40s", "1m41s"), line


def test_peak_mem_bytes_on_the_cpu_is_in_bytes():
    """ru_maxrss is KiB on Linux: a process that has touched a 64 MiB buffer peaked at 64 MiB or more."""
    import torch
    from pipetrain.metrics import peak_memory_bytes
    buf = torch.ones(16 * 2 ** 20)  # 64 MiB of fp32, written
    assert peak_memory_bytes(torch.device("cpu")) >= buf.numel() * 4


def _matmul_weights(cfg) -> int:
    """Weights a token multiplies by in the blocks and the head, counted on a built model: every 2-D weight of
    the blocks (q, k, v, o, the MLP's) and the LM head; the embedding is a lookup, the norms no matmul."""
    from pipetrain.models import build
    model = build(cfg)
    blocks = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() == 2)
    return blocks + cfg.vocab_size * cfg.d_model


@pytest.mark.parametrize("family, extra", [("llama", dict(n_kv_heads=2)), ("gpt2", {}),
                                           ("mistral", dict(n_kv_heads=1, sliding_window=8))])
def test_flops_per_token_counts_each_matmul_of_the_built_model(family, extra):
    """docs/mfu.md: 3 x (2 x the weights a token multiplies by + attention's 2 x 2 Hq K T_eff per block), with
    T_eff = T/2 for a causal mask, the window W when W < T. Weights counted on the model as built (GQA's
    narrow k and v, gpt2's two-matrix MLP)."""
    from pipetrain.config import ModelConfig
    cfg = ModelConfig(family=family, vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=32, **extra)
    t = 32
    t_eff = cfg.sliding_window if cfg.sliding_window else t / 2
    attention = cfg.n_layers * 2 * 2 * cfg.n_heads * cfg.head_dim * t_eff
    assert flops_per_token(cfg, t) == pytest.approx(3 * (2 * _matmul_weights(cfg) + attention), rel=1e-12)
