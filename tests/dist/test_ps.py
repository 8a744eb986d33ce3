"""The parameter server (parallel.ps_servers) against the all-reduce run: bsp gives the single-process
loss at every step in every layout; ssp's staleness bound and async's staleness records from the
servers' logs; a checkpoint's round trip through a run without servers; the pull/push byte formulas."""
from __future__ import annotations

import json
import os

import pytest
import torch

from pipetrain.build import build_server
from pipetrain.checkpoint import TensorReader, read_manifest
from pipetrain.config import ModelConfig
from pipetrain.parallel.dims import ParallelDims
from pipetrain.parallel.ps import pull_bytes, push_bytes
from tests.dist.common import replica_recipe, replica_trainer
from tests.harness import EXACT_FP32, TP_FP32, rank_results

# a vocabulary large enough that a batch (8 x 16 tokens) leaves most rows untouched
MODEL = ModelConfig(family="llama", vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    ffn_hidden=64, max_seq_len=32)


def _run(rank, world, out, keys, steps, resume=None):
    """One rank of a run: a server serves until told to stop; a worker trains and returns its history,
    the compact ids it pulled per step, and its global step."""
    p = {k: v for k, v in keys.items() if k in ("ps_servers", "ps_sync", "staleness", "sequence_parallel",
                                                 "microbatches", "zero", "faults", "grad_clip")}
    os.makedirs(out, exist_ok=True)
    dims = ParallelDims.init(_parallel(keys))
    if dims.is_server:
        build_server(replica_recipe(out, dims, steps=steps, model=MODEL, **p), dims, resume=resume).serve()
        return None
    trainer = replica_trainer(out, dims, steps=steps, model=MODEL, resume=resume, **p)
    unique = []
    begin = trainer.ps.begin_step if trainer.ps is not None else None
    if begin is not None:
        def spy(step, inputs):
            unique.append(int(torch.unique(inputs).numel()))
            begin(step, inputs)
        trainer.ps.begin_step = spy
    history = trainer.fit()
    return {"history": history, "unique": unique, "dims": (dims.dp_rank, dims.pp_rank, dims.tp_rank)}


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
    # bytes: what each pusher reports equals the unique-row formula of its batch
    d, servers = MODEL.d_model, keys["ps_servers"]
    for r in got:
        if r is None or r["dims"][1:] != (0, 0):
            continue
        for record, unique in zip(r["history"], r["unique"]):
            asked = servers  # every server owns some of a batch's rows here (checked below)
            assert record["ps_pull_bytes"] == pull_bytes(unique, d, asked)
            assert record["ps_push_bytes"] == push_bytes(unique, d, asked)
            assert unique * d * 4 < MODEL.vocab_size * d * 4  # U x d, not V x d


def test_ssp_pulls_stay_within_the_staleness_bound(tmp_path):
    """ssp s=2 with worker 0 slowed 8x: the fast worker runs ahead and pulls rows older than the last
    step, but never more than s versions behind (every pull in the server's log)."""
    from pipetrain.config import FaultsConfig
    s, steps = 2, 6
    keys = dict(ps_servers=1, ps_sync="ssp", staleness=s, grad_clip=0.0,
                faults=FaultsConfig(slow_ranks=[0], slow_factor=8.0, slow_prob=1.0))
    got = rank_results(3, _run, str(tmp_path), keys, steps)
    pulls = [e for e in _server_log(str(tmp_path)) if e["event"] == "pull" and e["step"] <= steps]
    train = [e for e in pulls if e["required"] == max(0, e["step"] - 1 - s)]
    assert len(train) >= 2 * steps  # every worker's pull of every step
    lags = [(e["step"] - 1) - e["version"] for e in train]
    assert max(lags) <= s, lags
    assert max(lags) >= 1, lags  # the bound was used: some pull did not wait for the last step
    applies = [e for e in _server_log(str(tmp_path)) if e["event"] == "apply"]
    assert [e["step"] for e in applies] == list(range(1, steps + 1))  # one update per step, in order
    assert all(r is None or len(r["history"]) == steps for r in got)


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


def test_servers_resume_a_plain_checkpoint_bitwise(tmp_path):
    """Servers read their rows of a checkpoint written without servers; saved again, every tensor is
    unchanged (the other direction and the full round trip: the slow test below)."""
    plain, ps = str(tmp_path / "plain"), str(tmp_path / "ps")
    rank_results(1, _run, plain, {}, 2)
    ckpt = os.path.join(plain, "checkpoints", "step-00000002")
    rank_results(3, _run, ps, dict(ps_servers=1), 2, ckpt)  # no steps left: it loads and saves again
    before, after = full_tensors(ckpt), full_tensors(os.path.join(ps, "checkpoints", "step-00000002"))
    assert sorted(before) == sorted(after)
    for name in before:
        assert torch.equal(before[name], after[name]), name


@pytest.mark.slow
def test_checkpoint_round_trip_through_a_run_without_servers(tmp_path):
    """A PS checkpoint loads into a run without servers and back, bitwise; and training resumed with
    servers from it continues the single-process run."""
    a, b, c = (str(tmp_path / n) for n in ("a", "b", "c"))
    rank_results(3, _run, a, dict(ps_servers=1), 2)
    ckpt_a = os.path.join(a, "checkpoints", "step-00000002")
    rank_results(1, _run, b, {}, 2, ckpt_a)  # no steps left: it loads and saves again
    ckpt_b = os.path.join(b, "checkpoints", "step-00000002")
    rank_results(3, _run, c, dict(ps_servers=1), 2, ckpt_b)  # and back into servers
    ckpt_c = os.path.join(c, "checkpoints", "step-00000002")
    ta, tb, tc = full_tensors(ckpt_a), full_tensors(ckpt_b), full_tensors(ckpt_c)
    assert sorted(ta) == sorted(tb) == sorted(tc)
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
