"""The parameter server's pieces without processes: the compact-table embedding against a dense one,
row ranges, version bounds, byte formulas, the recipe checks (exit 2 through the CLI), and a Server
driven through a scripted in-process transport (the ssp hold-back of a pull that runs too far ahead; a
save that waits for every pusher's pushes; a resumed server serving the rows the original served)."""
import dataclasses
import json
import os

import pytest
import torch
import torch.nn.functional as F

from pipetrain.config import ParallelConfig, Recipe, RunConfig
from pipetrain.models.init import init_rows, init_tensor
from pipetrain.parallel.ps import server as ps
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.mesh.rules import layout_problems, parallel_problems
from pipetrain.parallel.ps.client import PSEmbedding
from pipetrain.parallel.ps.protocol import (OP_PULL, OP_PUSH, OP_SAVE, OP_STOP, TAG_ROWS, header, pull_bytes, push_bytes,
                                            required_version, row_range)
from pipetrain.parallel.ps.server import Server
from tests.unit.common import GPT2, LLAMA


def test_compact_table_gives_the_dense_embedding_and_its_row_gradients():
    torch.manual_seed(0)
    table = torch.randn(64, 8, requires_grad=True)
    ids = torch.randint(0, 64, (3, 10))
    unique = torch.unique(ids)
    compact = table.detach()[unique].clone().requires_grad_()
    embed = PSEmbedding(64, 8)
    embed.set_table(unique, compact)
    out = embed(ids)
    torch.testing.assert_close(out, F.embedding(ids, table.detach()), rtol=0, atol=0)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    (F.embedding(ids, table) * weights).sum().backward()
    torch.testing.assert_close(compact.grad, table.grad[unique])  # one summed row per unique id
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[unique] = False
    assert torch.all(table.grad[untouched] == 0)  # what a dense all-reduce would carry for nothing


def test_row_ranges_versions_and_bytes():
    assert [row_range(10, 3, i) for i in range(3)] == [(0, 4), (4, 8), (8, 10)]
    assert required_version("bsp", 0, 5) == 4
    assert required_version("ssp", 2, 5) == 2 and required_version("ssp", 2, 1) == 0
    assert required_version("async", 0, 9) == 0
    # U ids (int64) out, U fp32 rows of d back; one header (4 int64) out and a version (int64) back per server
    assert pull_bytes(100, 16, 2) == 100 * 8 + 100 * 16 * 4 + 2 * (32 + 8)
    assert push_bytes(100, 16, 2) == 2 * 32 + 100 * 8 + 100 * 16 * 4


def _problems(model=LLAMA, **parallel):
    return parallel_problems(Recipe(model=model, parallel=ParallelConfig(**parallel)))


# (V, d, servers, chunk elements): uneven splits, rows shorter than a 16-element block, a chunk boundary inside
# a row, a tail under 16 elements, one server
CHUNKED = [(1000, 8, 3, 64), (37, 3, 4, 16), (97, 5, 2, 48), (101, 7, 3, 16), (256, 16, 1, 1024)]


@pytest.mark.parametrize("vocab,d,servers,chunk", CHUNKED)
def test_a_servers_chunked_init_is_bitwise_its_rows_of_the_full_table_draw(vocab, d, servers, chunk):
    m = dataclasses.replace(LLAMA, vocab_size=vocab, d_model=d)
    full = init_tensor(m, "embed.weight", (vocab, d), 1234)
    for i in range(servers):
        lo, hi = row_range(vocab, servers, i)
        rows = init_rows(m, "embed.weight", (vocab, d), 1234, lo, hi, chunk=chunk)
        assert rows.shape == (hi - lo, d) and torch.equal(rows, full[lo:hi]), (vocab, d, servers, i)


def test_a_server_holds_only_its_rows_and_they_are_the_full_tables(tmp_path):
    m = dataclasses.replace(LLAMA, vocab_size=1001)
    recipe = Recipe(model=m, parallel=ParallelConfig(dp=2, ps_servers=2), run=RunConfig(output_dir=str(tmp_path)))
    full = init_tensor(m, "embed.weight", (m.vocab_size, m.d_model), recipe.train.seed)
    for index in range(2):
        server = Server(recipe, ParallelDims(dp=2, rank=2 + index, ps_servers=2), lambda step: 0.1)
        lo, hi = row_range(m.vocab_size, 2, index)
        assert torch.equal(server.weight.detach(), full[lo:hi])
        server._log.close()


def test_recipe_checks_name_the_key_and_the_fix():
    assert any("model.tie_embeddings" in p for p in _problems(model=GPT2, ps_servers=1))
    assert any("parallel.staleness >= 1" in p for p in _problems(ps_servers=1, ps_sync="ssp"))
    assert any("needs parameter servers" in p for p in _problems(ps_sync="async"))
    assert any("does not combine with parallel.dp_sync=local_sgd" in p
               for p in _problems(ps_servers=1, dp_sync="local_sgd", dp_shard=1))
    assert any("model.lora_rank" in p
               for p in _problems(model=dataclasses.replace(LLAMA, lora_rank=4), ps_servers=1))
    assert not [p for p in _problems(ps_servers=2, ps_sync="ssp", staleness=1) if "ps_" in p]
    # the world: workers = processes - servers, and the message counts the servers in
    recipe = Recipe(model=LLAMA, parallel=ParallelConfig(dp=2, ps_servers=1))
    problems = layout_problems(recipe, 1)  # 2 processes launched, minus the server
    assert any("launch 3 processes (2 workers + 1 server(s)" in p for p in problems), problems
    assert not layout_problems(recipe, 2)


# -- a Server with its transport replaced by a script ---------------------------------------------------
class _Sent:
    """The Work of a reply the scripted wire has already taken."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _ScriptedWire:
    """What Server.serve() reads and sends, in one process: it reads `messages` in order, each a sender
    rank and its tensors (the header first, then the payloads); each reply is kept with the number of
    messages the server had read when it sent it, so a held pull shows as a late reply."""

    def __init__(self, messages: list):
        self.messages, self.read, self.payload, self.replies = messages, 0, [], []

    def recv_any_(self, header, pg, tag=0):
        src, tensors = self.messages[self.read]
        self.read += 1
        header.copy_(tensors[0])
        self.payload = list(tensors[1:])
        return src

    def recv_(self, x, src, pg, tag=0):
        return x.copy_(self.payload.pop(0))

    def isend(self, x, dst, pg, tag=0):
        self.replies.append((self.read, dst, tag, x.clone()))
        return _Sent()

    def pulls_answered(self, worker: int) -> list:
        """(messages read when answered, version served, rows) of each of worker's pulls, in order."""
        sent = [(read, t) for read, dst, tag, t in self.replies if dst == worker and tag == TAG_ROWS]
        return [(read, int(version[0]), rows) for (read, version), (_, rows) in zip(sent[::2], sent[1::2])]


def _pull(worker, step, ids, staleness):
    return worker, [header(OP_PULL, step, ids.numel(), required_version("ssp", staleness, step)), ids]


def _push(worker, step, ids, grad, version):
    return worker, [header(OP_PUSH, step, ids.numel(), version), ids, grad]


@pytest.mark.parametrize("staleness,held", [(1, True), (2, False)], ids=["s1-held", "s2-answered"])
def test_ssp_server_holds_a_pull_until_the_apply_its_staleness_needs(tmp_path, monkeypatch, staleness, held):
    """Worker 0 pushes steps 1 and 2 and asks for step 3's rows while worker 1 has not pushed step 1, so
    the server is still at version 0 and worker 0 is two steps ahead. Step 3 needs version 3 - 1 - s:
    with s = 1 the pull waits for worker 1's step-1 push (which applies step 1) and gets the updated
    rows; with s = 2 it is answered at once with the rows of version 0."""
    recipe = Recipe(model=LLAMA, parallel=ParallelConfig(dp=2, ps_servers=1, ps_sync="ssp", staleness=staleness),
                    run=RunConfig(output_dir=str(tmp_path), progress=False))
    server = Server(recipe, ParallelDims(dp=2, rank=2, ps_servers=1), lambda step: 0.1)
    ids = torch.tensor([1, 5, 9])
    grad = torch.randn(3, LLAMA.d_model)
    wire = _ScriptedWire([_pull(0, 1, ids, staleness), _push(0, 1, ids, grad, 0),
                          _pull(0, 2, ids, staleness), _push(0, 2, ids, grad, 0),
                          _pull(0, 3, ids, staleness),  # message 5: worker 0 is two steps ahead
                          _pull(1, 1, ids, staleness), _push(1, 1, ids, grad, 0),  # message 7: step 1 complete
                          (0, [header(OP_STOP, 3)])])
    for name in ("recv_any_", "recv_", "isend"):
        monkeypatch.setattr(ps, name, getattr(wire, name))
    server.serve()

    first, second, third = wire.pulls_answered(0)
    assert first[:2] == (1, 0) and second[:2] == (3, 0)  # steps 1 and 2 need nothing: answered on arrival
    read, version, rows = third
    if held:
        assert (read, version) == (7, 1), (read, version)  # after worker 1's push, from the version it made
        torch.testing.assert_close(rows, server.weight.detach()[ids], rtol=0, atol=0)
        assert not torch.equal(rows, first[2])  # the update of step 1 is in the rows
    else:
        assert (read, version) == (5, 0), (read, version)  # on arrival, two versions behind step 2
        assert torch.equal(rows, first[2])
    with open(os.path.join(tmp_path, "ps-server-0.jsonl")) as f:
        log = [json.loads(line) for line in f]
    assert [e["step"] for e in log if e["event"] == "apply"] == [1]  # step 2 still waits for worker 1
    late = next(i for i, e in enumerate(log) if e["event"] == "pull" and e["worker"] == 0 and e["step"] == 3)
    assert log[late]["required"] == 2 - staleness and log[late]["version"] == version
    applied = next(i for i, e in enumerate(log) if e["event"] == "apply")
    assert (applied < late) == held  # the log shows the hold: the pull is answered after the apply


class _Checkpointer:
    """Takes the server's checkpoint state at each save, as the real one snapshots it."""

    def __init__(self):
        self.saves = []

    def save(self, server):
        step, items, _ = server.checkpoint_state(False)
        self.saves.append((step, server.version, [(n, t.clone(), g, o) for n, t, g, o in items]))

    def wait(self):
        pass


def _server(tmp_path, mode, staleness=0):
    recipe = Recipe(model=LLAMA, parallel=ParallelConfig(dp=2, ps_servers=1, ps_sync=mode, staleness=staleness),
                    run=RunConfig(output_dir=str(tmp_path), progress=False))
    server = Server(recipe, ParallelDims(dp=2, rank=2, ps_servers=1), lambda step: 0.1)
    server.checkpointer = _Checkpointer()
    return server


def _serve(server, monkeypatch, messages) -> _ScriptedWire:
    wire = _ScriptedWire(messages)
    for name in ("recv_any_", "recv_", "isend"):
        monkeypatch.setattr(ps, name, getattr(wire, name))
    server.serve()
    return wire


def _save(worker, step):
    return worker, [header(OP_SAVE, step)]


@pytest.mark.parametrize("mode,version", [("ssp", 1), ("async", 2)])
def test_a_save_waits_for_every_pushers_pushes_up_to_its_step(tmp_path, monkeypatch, mode, version):
    """Worker 0 pushes step 1 and reaches the save while worker 1's step-1 push is still on its way: the
    server snapshots once worker 1's push is in and applied, never the table of step 0 beside the workers'
    weights of step 1. Its version is part of the snapshot."""
    server = _server(tmp_path, mode, staleness=1)
    ids, grad = torch.tensor([1, 5, 9]), torch.randn(3, LLAMA.d_model)
    _serve(server, monkeypatch, [_push(0, 1, ids, grad, 0), _save(0, 1), _push(1, 1, ids, grad, 0), _save(1, 1),
                                 (0, [header(OP_STOP, 1)])])
    assert [(step, v) for step, v, _ in server.checkpointer.saves] == [(1, version)]  # once, all pushes applied
    items = {n: t for n, t, _, _ in server.checkpointer.saves[0][2]}
    assert items["ps/version"].tolist() == [version]
    assert torch.equal(items["model/embed.weight"], server.weight.detach())


def _checkpoint(items, step, layout):
    """(read, manifest) over a server's checkpoint items, as the TensorReader and manifest give them."""
    tensors = {n: (t, o) for n, t, _, o in items}

    def read(name, offsets, shape):
        t, saved_at = tensors[name]
        box = tuple(slice(o - s, o - s + n) for o, s, n in zip(offsets, saved_at, shape))
        return t[box].clone()
    manifest = {"step": step, "layout": layout,
                "tensors": {n: {"global_shape": list(g)} for n, _, g, _ in items}}
    return read, manifest


def test_a_resumed_ssp_server_serves_the_rows_its_original_served_ahead_of_the_save(tmp_path, monkeypatch):
    """ssp s=1: each worker asks for step 2's rows during step 1 (prefetch), so both get version 0; then
    step 1 applies and both save. The resumed server is at version 1, yet its answer to the same pulls is the
    original's: version 0 and those rows, so the resumed run trains on what the original trained on."""
    server = _server(tmp_path / "a", "ssp", staleness=1)
    ids = [torch.tensor([1, 5, 9]), torch.tensor([2, 5, 7, 11])]
    grads = [torch.randn(3, LLAMA.d_model), torch.randn(4, LLAMA.d_model)]
    wire = _serve(server, monkeypatch, [
        _pull(0, 1, ids[0], 1), _pull(1, 1, ids[1], 1), _pull(0, 2, ids[1], 1), _push(0, 1, ids[0], grads[0], 0),
        _pull(1, 2, ids[0], 1), _push(1, 1, ids[1], grads[1], 0), _save(0, 1), _save(1, 1),
        (0, [header(OP_STOP, 1)])])
    original = [wire.pulls_answered(w)[1] for w in (0, 1)]
    assert [v for _, v, _ in original] == [0, 0]
    step, version, items = server.checkpointer.saves[0]
    assert (step, version) == (1, 1)
    read, manifest = _checkpoint(items, 1, {"dp": 2, "tp": 1, "pp": 1, "ps_servers": 1})
    resumed = _server(tmp_path / "b", "ssp", staleness=1)
    resumed.load(read, manifest)
    assert resumed.version == 1 and torch.equal(resumed.weight, server.weight)
    wire = _serve(resumed, monkeypatch, [_pull(1, 2, ids[0], 1), _pull(0, 2, ids[1], 1),
                                         (0, [header(OP_STOP, 1)])])
    for worker in (0, 1):
        (_, v, rows), = wire.pulls_answered(worker)
        assert v == 0 and torch.equal(rows, original[worker][2]), worker
        assert not torch.equal(rows, resumed.weight.detach()[ids[1 - worker]])  # not the table at version 1
    with open(os.path.join(tmp_path / "b", "ps-server-0.jsonl")) as f:
        assert sorted((e["worker"], e["version"]) for e in map(json.loads, f)) == [(0, 0), (1, 0)]
