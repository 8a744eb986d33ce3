"""The parameter server (parallel.ps_servers) against the all-reduce run: bsp gives the single-process
loss at every step in every layout; ssp's staleness bound from the servers' logs, and a resumed ssp run
reading the original's versions; async applying every push once, in the order its log records, a resumed
async run counting on from the checkpoint's version; a checkpoint's round trip through a run without
servers; what the workers put on the wire, counted at the transport, against the unique-row formula;
prefetch's one pull per step."""
from __future__ import annotations

import dataclasses
import json
import os
import types

import numpy as np
import pytest
import torch

from pipetrain.build import build_server, build_trainer
from pipetrain.checkpoint.read import TensorReader, read_manifest
from pipetrain.config import CheckpointConfig, FaultsConfig, ModelConfig
from pipetrain.data import Loader, PackedData
from pipetrain.models.init import init_tensor
from pipetrain.optim.build import lr_at
from pipetrain.parallel.ps import client as ps_module
from pipetrain.optim.adamw import decays, set_lr
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.optim.torch_opt import build_torch_opt
from pipetrain.parallel.ps.protocol import required_version, row_range
from tests.dist.common import replica_recipe
from tests.harness import EXACT_FP32, TP_FP32, rank_results

# a vocabulary large enough that a batch (8 x 16 tokens) leaves most rows untouched
MODEL = ModelConfig(family="llama", vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    ffn_hidden=64, max_seq_len=32)


def _recipe(out, dims, steps, keys):
    """replica_recipe with the test's model, its parallel keys, faults and a checkpoint every keys["every"]."""
    p = {k: v for k, v in keys.items() if k in ("ps_servers", "ps_sync", "staleness", "sequence_parallel",
                                                 "microbatches", "zero", "grad_clip")}
    recipe = replica_recipe(out, dims, steps=steps, model=MODEL, faults=keys.get("faults"), **p)
    return dataclasses.replace(recipe, checkpoint=CheckpointConfig(every=keys.get("every", 0)))


def _run(rank, world, out, keys, steps, resume=None):
    """One rank of a run: a server serves until told to stop; a worker trains (fixed random tokens, as
    tests/dist/common.replica_trainer) and returns its history and what its PSClient did (_spy_on_ps)."""
    os.makedirs(out, exist_ok=True)
    dims = ParallelDims.init(_parallel(keys))
    recipe = _recipe(out, dims, steps, keys)
    if dims.is_server:
        build_server(recipe, dims, resume=resume).serve()
        return None
    rng = np.random.default_rng(0)
    num = 64 * 17
    data = PackedData(rng.integers(0, MODEL.vocab_size, num).astype(np.int32), np.ones(num, dtype=bool), 16, 0.0, 2)
    trainer = build_trainer(recipe, dims, loader=Loader(data, 8, dims.dp_rank, dims.dp), resume=resume)
    spy = _spy_on_ps(trainer) if trainer.ps is not None else {}
    history = trainer.fit()
    return {"history": history, "dims": (dims.dp_rank, dims.pp_rank, dims.tp_rank), **spy}


def _spy_on_ps(trainer) -> dict:
    """Watch this rank's PSClient from inside: every tensor it hands the transport (ps/client.py's isend, irecv,
    send_, recv_) is counted in bytes under what the client was doing, `wire[(kind, step)] = [out, in]`
    with kind pull (step's training rows, prefetched or not), eval, push, apply or control (save, stop);
    `events` orders the training pulls ("pull", step, trainer step when asked) and begin_step calls
    ("begin", step); `ids[t - 1]` are step t's unique token ids and `installed[t - 1]` says whether the
    table step t trained on is, value for value, the rows its pull received; `pushed[t]` is (ids, row
    gradients) of what step t's push sent (on pushers)."""
    client = trainer.ps
    spy = {"wire": {}, "events": [], "ids": [], "installed": [], "pushed": {}}
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

    push = during("push", client.push)

    def spied_push(step):
        out = push(step)
        if client.pusher:
            spy["pushed"][step] = (client.embed.ids.cpu().clone(), client.embed.table.grad.detach().cpu().clone())
        return out

    client._request = during("pull", client._request)
    client.begin_eval = during("eval", client.begin_eval)
    client.push = spied_push
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
    assert sorted(ps_final) == sorted(ref_final) + ["ps/version"]  # the servers' own state (bsp: the step)
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
    """A bsp pusher's bytes on the PS transport, counted at ps/client.py's send and receive calls, step by step:
    the unique-row formula U x d x 4 (fp32 rows) + U x 8 (ids) each way, plus the control messages
    (headers, the version a pull reply carries, the bsp norm reply, rank 0's APPLY); and the logged
    ps_pull_bytes / ps_push_bytes against the measured ones."""
    d, wire = MODEL.d_model, r["wire"]
    kinds = {kind for kind, _ in wire}
    assert kinds <= {"pull", "push", "apply", "control", "eval"}, kinds
    assert ("apply" in kinds) == rank0, kinds  # only rank 0 commands the updates
    # every pusher marks the final save in its stream (a header per server); rank 0 also sends the stop
    control = [sum(v[i] for (kind, _), v in wire.items() if kind == "control") for i in (0, 1)]
    assert control == [servers * HEADER * (2 if rank0 else 1), 0], wire
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


def _training_pulls(log, steps, mode, s=0):
    """The log's pulls of training steps (not the evaluation's after a step, which need another version)."""
    return [e for e in log if e["event"] == "pull" and e["step"] <= steps
            and e["required"] == required_version(mode, s, e["step"])]


def _ckpt(out, step):
    return os.path.join(out, "checkpoints", f"step-{step:08d}")


def test_ssp_stays_within_its_bound_and_a_resumed_run_reads_the_originals_versions(tmp_path):
    """ssp s=1 with a slow worker (faults), 2 workers + 1 server, a checkpoint at step 2 of 4.
    The run: each worker prefetches step t+1's rows right after step t's arrived, so every pull from step 2
    on lags the step before it by at least one version, and the server's log shows none lagging more than
    s (the hold-back itself, one worker steps ahead, is tested without processes: tests/unit/test_ps.py).
    With s = 1 that makes every version read exact (t - 2 at step t), whatever the timing.
    The resume from step 2, in the same folder: the server's log is cut back to step 2 and then holds the
    original's lines again; each step reads the version the original read (step 3's rows come from the
    version-1 table the original prefetched before the save, not the version-2 table the save holds), and
    so every loss and the final weights are bitwise the original's."""
    s, steps, k = 1, 4, 2
    out = str(tmp_path)
    keys = dict(ps_servers=1, ps_sync="ssp", staleness=s, grad_clip=0.0, every=k,
                faults=FaultsConfig(slow_ranks=[1], slow_factor=2.0))
    first = rank_results(3, _run, out, keys, steps)
    log = _server_log(out)
    train = _training_pulls(log, steps, "ssp", s)
    assert sorted((e["worker"], e["step"]) for e in train) == [(w, t) for w in (0, 1) for t in range(1, steps + 1)]
    lags = [(e["step"] - 1) - e["version"] for e in train if e["step"] > 1]
    assert all(1 <= lag <= s for lag in lags), lags
    applies = [e for e in log if e["event"] == "apply"]
    assert [e["step"] for e in applies] == list(range(1, steps + 1))  # one update per step, in order
    for r in first[:2]:
        assert len(r["history"]) == steps
        _check_prefetch(r, steps)
    assert read_manifest(_ckpt(out, k))["step"] == k
    weights = full_tensors(_ckpt(out, steps))

    resumed = rank_results(3, _run, out, keys, steps, _ckpt(out, k))
    assert sorted(map(json.dumps, _server_log(out))) == sorted(map(json.dumps, log))
    for a, b in zip(first[:2], resumed[:2]):
        assert [(r["step"], r["ps_version"], r["loss"]) for r in b["history"]] == \
            [(r["step"], r["ps_version"], r["loss"]) for r in a["history"][k:]]
        assert [r["ps_version"] for r in a["history"]] == [max(0, t - 2) for t in range(1, steps + 1)]
    again = full_tensors(_ckpt(out, steps))
    assert sorted(again) == sorted(weights) and all(torch.equal(again[n], weights[n]) for n in weights)


def _replay_async(applies, pushed, recipe) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    """The table async promises: from the seeded initial table, each push as its own AdamW step in the order
    the log applied it (the worker's row gradients times P, at lr / P for P pushers)."""
    m, pushers = recipe.model, 2
    weight = torch.nn.Parameter(init_tensor(m, "embed.weight", (m.vocab_size, m.d_model), recipe.train.seed))
    wd = recipe.train.weight_decay if decays("embed.weight", weight) else 0.0
    torch_opt = build_torch_opt([{"params": [weight], "weight_decay": wd}], recipe.train)
    for e in applies:
        ids, rows = pushed[(e["worker"], e["step"])]
        weight.grad = torch.zeros_like(weight).index_add_(0, ids, rows) * pushers
        set_lr(torch_opt, lr_at(e["step"], recipe.train) / pushers)
        torch_opt.step()
    return weight.detach(), torch_opt


@pytest.mark.slow
def test_async_applies_every_push_once_and_a_resumed_run_counts_on_from_the_saved_version(tmp_path):
    """async, 2 workers + 1 server, 6 steps, a checkpoint at step 3, then resumed from it in the same folder.
    What async promises, read from the server's log (cut back to step 3 by the resume, then the resumed
    steps): every worker's push of every step applied exactly once, each as the next version (the resumed
    run counting on from the checkpoint's, which is the number of pushes up to its step: nothing repeated,
    nothing restarted); each push's staleness is the updates applied between the pull its rows came from
    and its apply; each step trained on the version its pull's log line records; and the final table and
    its moments are exactly the replay of the pushes the workers sent, in the log's order."""
    steps, k = 6, 3
    out = str(tmp_path)
    keys = dict(ps_servers=1, ps_sync="async", every=k)
    first = rank_results(3, _run, out, keys, steps)
    assert full_tensors(_ckpt(out, k))["ps/version"].tolist() == [2 * k]  # every push up to the save's step
    resumed = rank_results(3, _run, out, keys, steps, _ckpt(out, k))
    log = _server_log(out)
    applies = [e for e in log if e["event"] == "apply"]
    assert sorted((e["worker"], e["step"]) for e in applies) == [(w, t) for w in (0, 1) for t in range(1, steps + 1)]
    assert [e["version"] for e in applies] == list(range(1, 2 * steps + 1))
    pulls = {}
    for e in _training_pulls(log, steps, "async"):
        assert (e["worker"], e["step"]) not in pulls, e  # one pull per worker and step
        pulls[(e["worker"], e["step"])] = e["version"]
    for e in applies:
        assert e["staleness"] == e["version"] - 1 - pulls[(e["worker"], e["step"])], e
    pushed = {}
    for w in (0, 1):
        for r in first[w]["history"][:k] + resumed[w]["history"]:
            assert r["ps_version"] == pulls[(w, r["step"])], (w, r)
        pushed.update({(w, t): v for t, v in first[w]["pushed"].items() if t <= k})
        pushed.update({(w, t): v for t, v in resumed[w]["pushed"].items()})
    recipe = _recipe(out, types.SimpleNamespace(tp=1, pp=1), steps, keys)
    weight, torch_opt = _replay_async(applies, pushed, recipe)
    final = full_tensors(_ckpt(out, steps))
    assert torch.equal(final["model/embed.weight"], weight)
    state = torch_opt.state[torch_opt.param_groups[0]["params"][0]]
    for moment in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(final[f"optim/{moment}/embed.weight"], state[moment]), moment


def test_checkpoint_round_trip_through_a_run_without_servers_is_bitwise(tmp_path):
    """A PS checkpoint loads into a run without servers and back: servers write their rows under the plain
    run's names, and servers read their rows of a plain checkpoint; every tensor is unchanged. The servers'
    own state (ps/version: bsp's is the step) is only in checkpoints written with servers. (Training on from
    a plain checkpoint with servers: the slow test below.)"""
    a, b, c = (str(tmp_path / n) for n in ("a", "b", "c"))
    rank_results(3, _run, a, dict(ps_servers=1), 2)
    ckpt_a = os.path.join(a, "checkpoints", "step-00000002")
    rank_results(1, _run, b, {}, 2, ckpt_a)  # no steps left: it saves the checkpoint of folder a in its layout
    ckpt_b = os.path.join(b, "checkpoints", "step-00000002")
    rank_results(3, _run, c, dict(ps_servers=1), 2, ckpt_b)  # and back into servers
    ckpt_c = os.path.join(c, "checkpoints", "step-00000002")
    ta, tb, tc = full_tensors(ckpt_a), full_tensors(ckpt_b), full_tensors(ckpt_c)
    assert sorted(ta) == sorted(tc) == sorted(tb) + ["ps/version"]
    assert ta["ps/version"].tolist() == tc["ps/version"].tolist() == [2]
    assert read_manifest(ckpt_a)["layout"]["ps_servers"] == 1 and read_manifest(ckpt_b)["layout"]["ps_servers"] == 0
    for name in tb:
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
