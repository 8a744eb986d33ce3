"""The parameter server's pieces without processes: the compact-table embedding against a dense one,
row ranges, version bounds, byte formulas, and the recipe checks (exit 2 through the CLI)."""
import dataclasses

import torch
import torch.nn.functional as F

from pipetrain.config import ParallelConfig, Recipe, validate
from pipetrain.parallel.layout import layout_problems
from pipetrain.parallel.ps import PSEmbedding, pull_bytes, push_bytes, required_version, row_range
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
    return validate(Recipe(model=model, parallel=ParallelConfig(**parallel)))


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
