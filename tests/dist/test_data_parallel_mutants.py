"""Parameter-server cases the default suite does not run, against the same model and batches in one process.

A mutation audit of pipetrain/parallel/{data,replicas/dbs.py,ps} found realistic bugs that the default
suite let through (caught only by the slow tp / two-server layouts of tests/dist/test_ps.py, or by
nothing); each test here fails on one of them within seconds:
- bsp with two servers: a server indexing its dense gradient by global row ids (not ids - lo), a pull
  asking server 0 for the first row of server 1, a pusher keeping only the last server's squared norm;
- bsp with an active clip: a server applying the summed gradient without the workers' clip factor (the
  default bsp run compares the moments too, but its norms stay under train.grad_clip=1: nothing clips);
- bsp under dp 2 x tp 2 with sequence parallelism: the row gradients not summed over tp before the push,
  the rows broadcast over tp from global rank 0 (not this dp rank's pusher), and the servers' squared norm
  added after the tp sum (so only tp rank 0 counts the table, and the tp ranks clip by different factors).
"""
import os

import torch

from tests.dist.test_ps import _run, full_tensors
from tests.harness import TP_FP32, run_ranks

TIMEOUT_S = 30  # a mis-addressed send or a server waiting for a push hangs: fail in half a minute
STEPS = 3
CLIP = 0.05  # the suite's model has gradient norms of about 0.3-1 here: every step clips
STATE_AFTER_ADAM = dict(rtol=1e-4, atol=1e-5)  # as tests/dist/test_ps.py: row sums in another order, over sqrt(v)


def _saved_run(rank, world_size, out, keys):
    torch.save(_run(rank, world_size, out, keys, STEPS), os.path.join(out, f"rank{rank}.pt"))


def _results(world: int, out: str, keys: dict) -> list:
    """tests/dist/test_ps._run on `world` gloo processes (servers return None), each rank's result."""
    os.makedirs(out)
    run_ranks(world, _saved_run, out, keys, timeout_s=TIMEOUT_S)
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def test_bsp_two_servers_under_dp2_tp2_sequence_parallel_with_clipping_gives_the_single_process_run(tmp_path):
    """dp 2 x tp 2 (sequence parallel) workers + 2 servers, every step clipped: every worker logs the
    single process's loss and gradient norm at every step (the norm counts the servers' table once), and
    the servers end with the one-process run's table and AdamW moments."""
    ref = _results(1, str(tmp_path / "ref"), dict(grad_clip=CLIP))[0]["history"]
    keys = dict(tp=2, sequence_parallel=True, ps_servers=2, grad_clip=CLIP)
    got = [r for r in _results(6, str(tmp_path / "ps"), keys) if r is not None]
    assert len(got) == 4 and all(r["grad_norm"] > CLIP for r in ref), ref  # the clip acts at every step
    for r in got:
        for what in ("loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor([h[what] for h in r["history"]]),
                                       torch.tensor([h[what] for h in ref]), **TP_FP32,
                                       msg=lambda m: f"dp {r['dims'][0]} tp {r['dims'][2]} {what}: {m}")
    # AdamW hides a missing clip factor in the weights (a first step moves by lr x sign(g) at any scale);
    # the moments keep it: the servers' rows of the final checkpoint are the one-process run's
    got_final, ref_final = (full_tensors(str(tmp_path / run / "checkpoints" / f"step-{STEPS:08d}"))
                            for run in ("ps", "ref"))
    for name in ("model/embed.weight", "optim/exp_avg/embed.weight", "optim/exp_avg_sq/embed.weight"):
        torch.testing.assert_close(got_final[name], ref_final[name], **STATE_AFTER_ADAM, msg=lambda m: f"{name}: {m}")

