"""Dynamic-batch damping and parameter-server promises the default suite left unchecked, without processes:
DynamicBatch fed measured slot times, and a Server driven through the scripted transport of
tests/unit/test_ps.py, each checked against a hand computation.

A mutation audit of pipetrain/parallel/{data,replicas/dbs.py,ps} found realistic bugs that the default
suite let through (only the slow async test, or nothing, caught them); each test here fails on one:
- dbs: a window's measurements kept after its update (the next update then runs on one new step), and the
  streak kept after a split is adopted (the next split then moves after one window, not DBS_WINDOWS);
- dbs: the predicted step time counting microbatches without the pipeline's pp - 1 bubble slots;
- dbs (pipetrain/trainer.py): a replica's scale to its own mean (relaxed sync's logged loss, local SGD's
  gradient) taken as dp_replicate whatever the split, not global batch / the replica's samples;
- bsp: an evaluation after step t asking for the table of version t - 1 (step t's update not yet in it,
  whenever another worker's pull reaches the server before rank 0's APPLY);
- async: a push applied at the full learning rate instead of lr / P (the P pushers' pushes then add up
  to P synchronous steps, not one);
- async: the staleness logged for a push counted after its own update (every push one staler than it was).
"""
import json
import os
import types

import torch

from pipetrain.config import ParallelConfig, Recipe, RunConfig, TrainConfig
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.replicas.dbs import DBS_GAIN, DBS_WINDOWS, DynamicBatch
from pipetrain.parallel.ps import client as ps_client
from pipetrain.parallel.ps import server as ps
from pipetrain.parallel.ps.client import PSClient, PSEmbedding
from pipetrain.parallel.ps.protocol import OP_PULL, OP_STOP, header
from pipetrain.parallel.ps.server import Server
from pipetrain.trainer import Trainer
from tests.unit.common import LLAMA
from tests.unit.test_ps import _push, _ScriptedWire, _Sent

LR = 0.1


def _window(dbs: DynamicBatch, slot: list[float], steps: int) -> bool:
    """Observe `steps` steps of the same seconds per slot, then update; whether the split moved."""
    for _ in range(steps):
        dbs.observe(slot)
    return dbs.update()


def test_every_new_split_waits_for_two_full_windows_of_fresh_measurements():
    """every=2: the split moves only after DBS_WINDOWS windows of `every` steps each, counted afresh after
    each update and after each move. Replica 3 slow: [3, 2, 2, 1] after windows 1 and 2 (window 2 needs
    two new steps, not one); then replica 0 slow: quotas 8 x (0.5, 1, 1, 1) / 3.5 = 1.14, 2.29, 2.29, 2.29,
    the spare microbatch to index 1: [1, 3, 2, 2], again only after two new windows."""
    assert (DBS_GAIN, DBS_WINDOWS) == (0.10, 2)
    dbs = DynamicBatch(replicas=4, microbatches=2, every=2, pp=1, granule=1, minimum=1)
    assert not _window(dbs, [1.0, 1.0, 1.0, 2.0], 2)
    assert not _window(dbs, [1.0, 1.0, 1.0, 2.0], 1), "an update after one step of the second window"
    assert _window(dbs, [1.0, 1.0, 1.0, 2.0], 1) and dbs.counts == [3, 2, 2, 1]
    assert not _window(dbs, [2.0, 1.0, 1.0, 1.0], 2), "a move after one window right after the last move"
    assert _window(dbs, [2.0, 1.0, 1.0, 1.0], 2) and dbs.counts == [1, 3, 2, 2]
    assert dbs.changes == 2


def test_a_pipelines_bubble_counts_in_the_gain_that_moves_the_split():
    """pp 2, 4 + 4 microbatches, replica 1 35% slower per slot: the proposal is [5, 3] (quotas 4.60, 3.40).
    A step of k microbatches takes k + 1 slots: now 1.35 x 5 = 6.75 s, then max(1 x 6, 1.35 x 4) = 6 s,
    11% shorter: the split moves. Counted without the bubble (5.4 s -> 5 s, 7.4%) it would not."""
    dbs = DynamicBatch(replicas=2, microbatches=4, every=1, pp=2, granule=1, minimum=1)
    slot = [1.0, 1.35]
    assert dbs.propose(slot) == [5, 3]
    assert dbs.predicted([4, 4], slot) == 1.35 * 5 and dbs.predicted([5, 3], slot) == 6.0
    assert [_window(dbs, slot, 1) for _ in range(DBS_WINDOWS)] == [False, True] and dbs.counts == [5, 3]



def test_a_replicas_loss_under_a_moved_split_is_the_mean_over_its_own_samples():
    """2 replicas, the split moved to 6 + 2 of 8 microbatches. The global batch has 16 target tokens, 2 per
    microbatch: replica 0 holds 12 of them, replica 1 holds 4. A replica's loss summed over its tokens, each
    1.0, is the mean 1.0 over its own tokens (Trainer._replica_loss, what relaxed sync logs; the same scale
    makes local SGD's gradient the replica's own mean)."""
    dbs = DynamicBatch(replicas=2, microbatches=4, every=1, pp=1, granule=1, minimum=1, counts=[6, 2])
    for rank, tokens in ((0, 12), (1, 4)):
        trainer = types.SimpleNamespace(dbs=dbs, dims=types.SimpleNamespace(
            dp_replicate=2, dp_replicate_rank=rank, tp_rank=0, replica_group=None))
        trainer._replica_scale = types.MethodType(Trainer._replica_scale, trainer)
        torch.testing.assert_close(Trainer._replica_loss(trainer, torch.tensor(float(tokens)), 16), 1.0,
                                   msg=lambda m: f"replica {rank}: {m}")

def _async_server(tmp_path, optimizer: str) -> Server:
    recipe = Recipe(model=LLAMA, parallel=ParallelConfig(dp=2, ps_servers=1, ps_sync="async"),
                    train=TrainConfig(optimizer=optimizer, momentum=0.0, lr=LR),
                    run=RunConfig(output_dir=str(tmp_path), progress=False))
    return Server(recipe, ParallelDims(dp=2, rank=2, ps_servers=1), lambda step: LR)


def _serve(server, monkeypatch, messages) -> list[dict]:
    """Run the server over the scripted messages (then STOP); its log."""
    wire = _ScriptedWire(messages + [(0, [header(OP_STOP, 1)])])
    for name in ("recv_any_", "recv_", "isend"):
        monkeypatch.setattr(ps, name, getattr(wire, name))
    server.serve()
    with open(os.path.join(server.recipe.run.output_dir, "ps-server-0.jsonl")) as f:
        return [json.loads(line) for line in f]


def _pull(worker, step, ids):
    return worker, [header(OP_PULL, step, ids.numel(), 0), ids]


def test_async_sgd_pushes_of_one_step_add_up_to_one_synchronous_sgd_step(tmp_path, monkeypatch):
    """async with SGD: each of the P = 2 pushes is applied alone as (its rows x P) at lr / P, so once both
    are in the table moved by lr x (g0 + g1), the synchronous step on the summed gradient, whatever the order."""
    server = _async_server(tmp_path, "sgd")
    before = server.weight.detach().clone()
    gen = torch.Generator().manual_seed(0)
    ids = [torch.tensor([1, 5, 9]), torch.tensor([5, 7])]
    grads = [torch.randn(3, LLAMA.d_model, generator=gen), torch.randn(2, LLAMA.d_model, generator=gen)]
    _serve(server, monkeypatch, [_push(1, 1, ids[1], grads[1], 0), _push(0, 1, ids[0], grads[0], 0)])
    summed = torch.zeros_like(before).index_add_(0, ids[0], grads[0]).index_add_(0, ids[1], grads[1])
    torch.testing.assert_close(server.weight.detach(), before - LR * summed, rtol=1e-6, atol=1e-7)


def test_async_logs_each_pushs_staleness_as_the_updates_applied_since_its_pull(tmp_path, monkeypatch):
    """Both workers pull step 1's rows at version 0, then push: worker 1's push is applied first (nothing
    applied since its pull: staleness 0), worker 0's second (one update since: staleness 1)."""
    server = _async_server(tmp_path, "adamw")
    ids, grad = torch.tensor([2, 3]), torch.ones(2, LLAMA.d_model)
    log = _serve(server, monkeypatch, [_pull(0, 1, ids), _pull(1, 1, ids), _push(1, 1, ids, grad, 0),
                                       _push(0, 1, ids, grad, 0)])
    served = [(e["worker"], e["version"]) for e in log if e["event"] == "pull"]
    assert served == [(0, 0), (1, 0)], log
    applies = [(e["worker"], e["version"], e["staleness"]) for e in log if e["event"] == "apply"]
    assert applies == [(1, 1, 0), (0, 2, 1)], log


def test_bsp_evaluation_after_step_t_asks_for_the_table_with_step_ts_update(tmp_path, monkeypatch):
    """bsp: the training pull of step t needs version t - 1 (every update before it); an evaluation after
    step t needs version t, the table the one-process run evaluates. Read from the pull headers a pusher
    sends ([op, step, n, required version])."""
    sent = []
    monkeypatch.setattr(ps_client, "isend", lambda x, peer, pg, tag=0: sent.append(x.clone()) or _Sent())
    monkeypatch.setattr(ps_client, "irecv", lambda x, peer, pg, tag=0: _Sent())
    recipe = Recipe(model=LLAMA, parallel=ParallelConfig(dp=2, ps_servers=1),
                    run=RunConfig(output_dir=str(tmp_path), progress=False))
    client = PSClient(recipe, ParallelDims(dp=2, rank=0, ps_servers=1),
                      PSEmbedding(LLAMA.vocab_size, LLAMA.d_model))
    inputs = torch.tensor([[1, 5, 9]])
    client.begin_step(3, inputs)
    client.begin_eval(3, inputs)
    headers = [t.tolist() for t in sent if t.numel() == 4 and int(t[0]) == OP_PULL]
    assert headers == [[OP_PULL, 3, 3, 2], [OP_PULL, 3, 3, 3]], headers
