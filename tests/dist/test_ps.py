"""The parameter server (parallel.ps_servers) against the all-reduce run: bsp gives the single-process
loss at every step in every layout; ssp's staleness bound and async's staleness records from the
servers' logs; a checkpoint's round trip through a run without servers; what the workers put on the
wire, counted at the transport, against the unique-row formula; prefetch's one pull per step."""
from __future__ import annotations

import json
import os

import pytest
import torch

from pipetrain.build import build_server
from pipetrain.checkpoint import TensorReader, read_manifest
from pipetrain.config import ModelConfig
from pipetrain.parallel import ps as ps_module
from pipetrain.parallel.dims import ParallelDims
from pipetrain.parallel.ps import row_range
from tests.dist.common import replica_recipe, replica_trainer
from tests.harness import EXACT_FP32, TP_FP32, rank_results

# a vocabulary large enough that a batch (8 x 16 tokens) leaves most rows untouched
MODEL = ModelConfig(family="llama", vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    ffn_hidden=64, max_seq_len=32)


def _run(rank, world, out, keys, steps, resume=None):
    """One rank of a run: a server serves until told to stop; a worker trains and returns its history
    and what its PSClient did (_spy_on_ps)."""
    p = {k: v for k, v in keys.items() if k in ("ps_servers", "ps_sync", "staleness", "sequence_parallel",
                                                 "microbatches", "zero", "grad_clip")}
    os.makedirs(out, exist_ok=True)
    dims = ParallelDims.init(_parallel(keys))
    if dims.is_server:
        build_server(replica_recipe(out, dims, steps=steps, model=MODEL, **p), dims, resume=resume).serve()
        return None
    trainer = replica_trainer(out, dims, steps=steps, model=MODEL, resume=resume, **p)
    spy = _spy_on_ps(trainer) if trainer.ps is not None else {}
    history = trainer.fit()
    return {"history": history, "dims": (dims.dp_rank, dims.pp_rank, dims.tp_rank), **spy}


def _spy_on_ps(trainer) -> dict:
    """Watch this rank's PSClient from inside: every tensor it hands the transport (ps.py's isend, irecv,
    send_, recv_) is counted in bytes under what the client was doing, `wire[(kind, step)] = [out, in]`
    with kind pull (step's training rows, prefetched or not), eval, push, apply or control (save, stop);
    `events` orders the training pulls ("pull", step, trainer step when asked) and begin_step calls
    ("begin", step); `ids[t - 1]` are step t's unique token ids and `installed[t - 1]` says whether the
    table step t trained on is, value for value, the rows its pull received."""
    client = trainer.ps
    spy = {"wire": {}, "events": [], "ids": [], "installed": []}
    doing = []          # (kind, step) of the client call in progress
    rows_in = {}        # training pull step -> the fp32 row buffers posted for its replies

    def transport(name, outgoing):
        real = getattr(ps_module, name)

        def counted(x, peer, pg, tag=0):
            kind, step = doing[-1] if doing else ("outside a client call", -1)
            spy["wire"].setdefault((kind, step), [0, 0])[0 if outgoing else 1] += x.nbytes
            if kind == "pull" and not outgoing and x.dtype == torch.float32:
                rows_in.setdefault(step, []).append(x)
            return real(x, peer, pg, tag)
        setattr(ps_module, name, counted)  # a spawned process: the patch ends with it

    for name, outgoing in (("isend", True), ("send_", True), ("irecv", False), ("recv_", False)):
        transport(name, outgoing)

    def during(kind, method, step_arg=0):
        def wrapped(*args):
            kind_now = "eval" if doing and doing[-1][0] == "eval" else kind
            doing.append((kind_now, args[step_arg]))
            if kind_now == "pull":
                spy["events"].append(("pull", args[step_arg], trainer.step))
            try:
                return method(*args)
            finally:
                doing.pop()
        return wrapped

    begin_step = client.begin_step

    def spied_begin_step(step, inputs):
        spy["events"].append(("begin", step))
        begin_step(step, inputs)
        if not client.pusher:
            return
        ids = torch.unique(inputs.cpu())
        spy["ids"].append(ids.tolist())
        table = client.embed.table.detach().cpu()
        spy["installed"].append(torch.equal(client.embed.ids.cpu(), ids)
                                and torch.equal(table, torch.cat(rows_in.pop(step, [torch.empty(0)]))))

    client._request = during("pull", client._request)
    client.begin_eval = during("eval", client.begin_eval)
    client.push = during("push", client.push)
    client.apply = during("apply", client.apply)
    client._control = during("control", client._control, step_arg=1)
    client.begin_step = spied_begin_step
    return spy


def _parallel(keys):
    from pipetrain.config import ParallelConfig
    return ParallelConfig(tp=keys.get("tp", 1), pp=keys.get("pp", 1), ps_servers=keys.get("ps_servers", 0),
                          ps_sync=keys.get("ps_sync", "bsp"), staleness=keys.get("staleness", 0),
                          sequence_parallel=keys.get("sequence_parallel", False),
                          microbatches=keys.get("microbatches", 1), zero=keys.get("zero", 0))


def full_tensors(ckpt_dir: str) -> dict:
    """Every saved tensor of a checkpoint, whole, by its manifest name (model/..., optim/...)."""
    manifest = read_manifest(ckpt_dir)
    reader = TensorReader(ckpt_dir, manifest)
    return {name: reader.read(name, [0] * len(info["global_shape"]), tuple(info["global_shape"]))
            for name, info in manifest["tensors"].items()}


def _losses(results):
    return [r["loss"] for r in results[0]["history"]]


def _server_log(out, index=0):
    with open(os.path.join(out, f"ps-server-{index}.jsonl")) as f:
        return [json.loads(line) for line in f]


LAYOUTS = [
    pytest.param(dict(ps_servers=1), 3, EXACT_FP32, id="dp2+1server"),
    pytest.param(dict(pp=2, ps_servers=1, microbatches=2), 5, EXACT_FP32, marks=pytest.mark.slow,
                 id="dp2xpp2+1server"),
    pytest.param(dict(tp=2, ps_servers=2), 4, TP_FP32, marks=pytest.mark.slow, id="tp2+2servers"),
    pytest.param(dict(tp=2, sequence_parallel=True, ps_servers=2), 4, TP_FP32, marks=pytest.mark.slow,
                 id="tp2sp+2servers"),
]


@pytest.mark.parametrize("keys,world,tol", LAYOUTS)
def test_bsp_ps_gives_the_single_process_loss(tmp_path, keys, world, tol):
    steps = 4
    ref = rank_results(1, _run, str(tmp_path / "ref"), {}, steps)
    got = rank_results(world, _run, str(tmp_path / "ps"), keys, steps)
    torch.testing.assert_close(torch.tensor(_losses(got)), torch.tensor(_losses(ref)), **tol)
    norms = [r["grad_norm"] for r in got[0]["history"]]  # the global norm includes the servers' table
    torch.testing.assert_close(torch.tensor(norms), torch.tensor([r["grad_norm"] for r in ref[0]["history"]]),
                               **tol)
    # the table after training: the servers' rows in the final checkpoint equal the all-reduce run's
    ps_final = full_tensors(os.path.join(tmp_path / "ps", "checkpoints", "step-00000004"))
    ref_final = full_tensors(os.path.join(tmp_path / "ref", "checkpoints", "step-00000004"))
    assert sorted(ps_final) == sorted(ref_final)
    # the rows' gradient is summed in another order (the server adds each worker's rows; the all-reduce
    # adds dense tables), and Adam's division by sqrt(v) magnifies that round-off where v is tiny
    state_tol = dict(rtol=1e-4, atol=1e-5)
    for name in ("model/embed.weight", "optim/exp_avg/embed.weight", "optim/exp_avg_sq/embed.weight"):
        torch.testing.assert_close(ps_final[name], ref_final[name], **state_tol)
    pushers = [r for r in got if r is not None and r["dims"][1:] == (0, 0)]
    dp = (world - keys["ps_servers"]) // (keys.get("tp", 1) * keys.get("pp", 1))
    assert sorted(r["dims"][0] for r in pushers) == list(range(dp))  # one per dp rank
    for r in pushers:
        _check_prefetch(r, steps)
        _check_wire(r, keys["ps_servers"], rank0=r is got[0])
    for r in got:
        if r is not None and r["dims"][1:] != (0, 0):  # tp peers and later stages: no server traffic at all
            assert r["wire"] == {}, r["wire"]


ID, HEADER = 8, 4 * 8  # an int64 token id; a message header (op, step, n, aux as int64)


def _check_wire(r, servers, rank0):
    """A bsp pusher's bytes on the PS transport, counted at ps.py's send and receive calls, step by step:
    the unique-row formula U x d x 4 (fp32 rows) + U x 8 (ids) each way, plus the control messages
    (headers, the version a pull reply carries, the bsp norm reply, rank 0's APPLY); and the logged
    ps_pull_bytes / ps_push_bytes against the measured ones."""
    d, wire = MODEL.d_model, r["wire"]
    kinds = {kind for kind, _ in wire}
    assert kinds <= {"pull", "push", "apply", "control", "eval"}, kinds
    assert ("apply" in kinds) == ("control" in kinds) == rank0, kinds  # only rank 0 commands the servers
    for step, (record, ids) in enumerate(zip(r["history"], r["ids"]), start=1):
        unique = len(ids)
        asked = sum(any(lo <= i < hi for i in ids) for lo, hi in (row_range(MODEL.vocab_size, servers, k)
                                                                   for k in range(servers)))
        rows = unique * d * 4
        # pull: the ids and a header to each server owning some of them; the rows and a version back
        assert wire[("pull", step)] == [unique * ID + asked * HEADER, rows + asked * 8], (step, wire)
        # push: a header to every server (bsp counts every pusher's push, even an empty one), the ids and
        # rows; each server answers with its shard's squared gradient norm (one fp64)
        assert wire[("push", step)] == [unique * ID + rows + servers * HEADER, servers * 8], (step, wire)
        if rank0:  # APPLY: a header and (clip factor, lr) as fp64 to every server
            assert wire[("apply", step)] == [servers * (HEADER + 16), 0], (step, wire)
        assert record["ps_pull_bytes"] == sum(wire[("pull", step)])
        assert record["ps_push_bytes"] == wire[("push", step)][0]  # the norm reply is not counted (docs)
        assert rows < MODEL.vocab_size * d * 4  # U x d, not the V x d an all-reduce moves


def _check_prefetch(r, steps):
    """One training pull per step; step t's (t >= 2) was asked during step t - 1, after begin_step(t - 1)
    and before begin_step(t); the table each step trained on holds exactly the rows that pull received,
    for the ids of that step's batch."""
    events = r["events"]
    pulls = [e for e in events if e[0] == "pull"]
    assert [e[1] for e in pulls] == list(range(1, steps + 1)), events
    for (_, step, during), asked in ((e, events.index(e)) for e in pulls):
        begun = events.index(("begin", step))
        if step == 1:  # nothing before it to prefetch it: asked inside begin_step
            assert during == 0 and begun < asked, events
        else:
            assert during == step - 2 and events.index(("begin", step - 1)) < asked < begun, events
    assert r["installed"] == [True] * steps


def test_ssp_training_pulls_stay_within_the_staleness_bound(tmp_path):
    """ssp s=1 end to end: each worker prefetches step t+1's rows right after step t's arrived, so every
    pull from step 2 on lags the step before it by at least one version, and the server's log shows none
    lagging more than s. The dense all-reduce keeps the workers within a step of each other, so here the
    server holds a pull back only when it races the other worker's push; the hold-back itself, with one
    worker steps ahead, is tested without processes (tests/unit/test_ps.py)."""
    s, steps = 1, 5
    got = rank_results(3, _run, str(tmp_path), dict(ps_servers=1, ps_sync="ssp", staleness=s, grad_clip=0.0), steps)
    log = _server_log(str(tmp_path))
    train = [e for e in log if e["event"] == "pull" and e["step"] <= steps
             and e["required"] == max(0, e["step"] - 1 - s)]  # not the evaluation's pulls after the last step
    assert sorted((e["worker"], e["step"]) for e in train) == [(w, t) for w in (0, 1) for t in range(1, steps + 1)]
    lags = [(e["step"] - 1) - e["version"] for e in train if e["step"] > 1]
    assert all(1 <= lag <= s for lag in lags), lags
    assert all(e["version"] >= e["required"] for e in train), train
    applies = [e for e in log if e["event"] == "apply"]
    assert [e["step"] for e in applies] == list(range(1, steps + 1))  # one update per step, in order
    for r in got[:2]:
        assert len(r["history"]) == steps
        _check_prefetch(r, steps)


@pytest.mark.slow
def test_async_applies_every_push_and_records_its_staleness(tmp_path):
    steps = 5
    got = rank_results(3, _run, str(tmp_path), dict(ps_servers=1, ps_sync="async"), steps)
    applies = [e for e in _server_log(str(tmp_path)) if e["event"] == "apply"]
    assert len(applies) == 2 * steps  # each of the two workers' pushes, each its own update
    assert sorted(e["version"] for e in applies) == list(range(1, 2 * steps + 1))
    assert all(0 <= e["staleness"] < 2 * steps for e in applies)
    losses = [r["loss"] for r in got[0]["history"]]
    assert all(torch.isfinite(torch.tensor(losses))) and len(losses) == steps


def test_checkpoint_round_trip_through_a_run_without_servers_is_bitwise(tmp_path):
    """A PS checkpoint loads into a run without servers and back: servers write their rows under the plain
    run's names, and servers read their rows of a plain checkpoint; every tensor is unchanged. (Training on
    from a plain checkpoint with servers: the slow test below.)"""
    a, b, c = (str(tmp_path / n) for n in ("a", "b", "c"))
    rank_results(3, _run, a, dict(ps_servers=1), 2)
    ckpt_a = os.path.join(a, "checkpoints", "step-00000002")
    rank_results(1, _run, b, {}, 2, ckpt_a)  # no steps left: it loads and saves again
    ckpt_b = os.path.join(b, "checkpoints", "step-00000002")
    rank_results(3, _run, c, dict(ps_servers=1), 2, ckpt_b)  # and back into servers
    ckpt_c = os.path.join(c, "checkpoints", "step-00000002")
    ta, tb, tc = full_tensors(ckpt_a), full_tensors(ckpt_b), full_tensors(ckpt_c)
    assert sorted(ta) == sorted(tb) == sorted(tc)
    assert read_manifest(ckpt_a)["layout"]["ps_servers"] == 1 and read_manifest(ckpt_b)["layout"]["ps_servers"] == 0
    for name in ta:
        assert torch.equal(ta[name], tb[name]) and torch.equal(ta[name], tc[name]), name


@pytest.mark.slow
def test_resumed_with_servers_from_a_plain_checkpoint_continues_like_one_process(tmp_path):
    plain = str(tmp_path / "plain")
    rank_results(1, _run, plain, {}, 2)
    ckpt = os.path.join(plain, "checkpoints", "step-00000002")
    ref = rank_results(1, _run, str(tmp_path / "ref"), {}, 4, ckpt)
    resumed = rank_results(3, _run, str(tmp_path / "ps"), dict(ps_servers=1), 4, ckpt)
    assert len(_losses(resumed)) == 2
    torch.testing.assert_close(torch.tensor(_losses(resumed)), torch.tensor(_losses(ref)), **EXACT_FP32)
