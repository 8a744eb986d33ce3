"""Context parallelism without processes: the head/tail slicing, the (local queries x all keys) mask against
the single-process document mask, the mesh with a cp axis, and the rules on parallel.cp."""
from __future__ import annotations

import os

import pytest
import torch

from pipetrain import cli
from pipetrain.config import ModelConfig, ParallelConfig, Recipe, TrainConfig
from pipetrain.models.decoder import document_mask
from pipetrain.parallel.context.attention import context_mask
from pipetrain.parallel.context.slicing import chunk_index, gathered_index
from pipetrain.elastic import SavedLayout, is_elastic
from pipetrain.parallel.mesh.dims import ParallelDims, mesh_rank_lists
from pipetrain.parallel.mesh.rules import layout_problems, parallel_problems

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "recipes", "tiny.yaml")
LLAMA = ModelConfig(family="llama", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    ffn_hidden=64, max_seq_len=64)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_cp_ranks_partition_the_sequence_with_equal_causal_work(cp):
    T = 32
    slices = [chunk_index(T, cp, r) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(slices)).values, torch.arange(T))
    assert torch.equal(gathered_index(T, cp), torch.cat(slices))
    # causal (query, key) pairs per rank: query i sees i + 1 keys; head/tail pairing makes them all equal
    work = [int((s + 1).sum()) for s in slices]
    assert work == [work[0]] * cp, f"causal work per cp rank {work}"
    assert slices[0][: T // (2 * cp)].tolist() == list(range(T // (2 * cp)))  # rank 0 holds the first chunk


def _positions(T: int, starts: list[int]) -> torch.Tensor:
    """(1, T) position of each token in its document; documents start at `starts` (and at 0)."""
    is_start = torch.zeros(T, dtype=torch.bool)
    is_start[[0] + starts] = True
    cols = torch.arange(T)
    return (cols - torch.cummax(torch.where(is_start, cols, 0), 0).values)[None]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("docs", [False, True])
def test_context_mask_is_the_single_process_masks_rows_and_columns(cp, window, docs):
    """Each rank's (T/cp x T) block is exactly the rows of its queries and the columns of the gathered keys
    of the single-process mask: causal, document (boundaries inside and across chunks) and sliding window."""
    T = 32
    positions = _positions(T, [3, 7, 8, 15, 20, 29]) if docs else torch.arange(T)[None]
    full = document_mask(positions, window)[0, 0]  # (T, T): positions 0..T-1 is one document
    keys = gathered_index(T, cp)
    for r in range(cp):
        queries = chunk_index(T, cp, r)
        block = context_mask(queries, keys, positions[:, queries], window)
        assert block.shape == (1, 1, T // cp, T)
        assert torch.equal(block[0, 0], full[queries][:, keys]), f"cp rank {r}"


def test_dims_place_cp_between_pp_and_tp():
    d = ParallelDims(dp=2, pp=2, cp=2, tp=2, rank=0)
    assert d.world_size == 16
    for rank in range(16):
        d = ParallelDims(dp=2, pp=2, cp=2, tp=2, rank=rank)
        assert d.global_rank(d.dp_rank, d.pp_rank, d.tp_rank, d.cp_rank) == rank
        assert (d.tp_rank, d.cp_rank, d.pp_rank, d.dp_rank) == (rank % 2, rank // 2 % 2, rank // 4 % 2, rank // 8)
    lists = d.group_rank_lists()
    assert lists["tp"][0] == [0, 1] and lists["cp"][0] == [0, 2] and lists["pp"][0] == [0, 4]
    assert lists["dp_cp"][0] == [0, 2, 8, 10]  # gradients sum over every rank with this (pp, tp) coordinate
    assert ParallelDims(dp=2, tp=2, rank=3).group_rank_lists()["dp_cp"] == []  # cp 1: dp_group itself


@pytest.mark.parametrize("dp, cp", [(1, 2), (2, 2), (2, 4), (3, 1)])
def test_zero_shards_over_dp_x_cp_in_the_dp_cp_groups_rank_order(dp, cp):
    """ZeRO's shard index is this rank's place in its dp x cp group (sorted global ranks, as new_group
    numbers them), so the row ranges the ranks own tile every parameter once."""
    for rank in range(dp * 2 * cp):  # tp 2: the shard group skips the tp peers
        dims = ParallelDims(dp=dp, cp=cp, tp=2, rank=rank)
        group = next(g for g in mesh_rank_lists(dims.mesh_shape, ("dp", "cp")) if rank in g)
        assert dims.zero_shard == dp * cp and dims.zero_shard_rank == sorted(group).index(rank), (dp, cp, rank)


def _recipe(seq_len=32, model=LLAMA, **parallel) -> Recipe:
    return Recipe(model=model, parallel=ParallelConfig(**parallel), train=TrainConfig(global_batch=8, seq_len=seq_len))


def test_seq_len_must_split_into_two_chunks_per_cp_rank():
    assert parallel_problems(_recipe(cp=2)) == []
    (line,) = parallel_problems(_recipe(seq_len=30, cp=2))
    assert line == ("train.seq_len: must be divisible by 2*parallel.cp=4 (each cp rank takes one head and one tail "
                    "chunk of every sequence), got 30; use a multiple of 4")
    (line,) = parallel_problems(_recipe(seq_len=36, cp=2, tp=4, sequence_parallel=True))
    assert "seq_len/cp=18 must be divisible by parallel.tp=4" in line
    assert parallel_problems(_recipe(cp=0)) == ["parallel.cp=0 must be >= 1"]


def test_world_must_cover_dp_cp_tp_pp():
    assert layout_problems(_recipe(cp=2, tp=2), 8) == []
    (line,) = layout_problems(_recipe(cp=2, tp=2), 6)
    assert "parallel.tp*parallel.pp*parallel.cp=4" in line
    (line,) = layout_problems(_recipe(cp=2, dp=2), 8)
    assert "parallel.dp*tp*pp*cp=2*1*1*2=4 does not equal the world size 8" in line


@pytest.mark.parametrize("keys, fragment", [
    (dict(zero=1, dp_shard=1), "parallel.dp_shard=1: does not combine with parallel.cp=2"),
    (dict(dp_sync="local_sgd"), "parallel.dp_sync=local_sgd: does not combine"),
    (dict(dynamic_batch=True), "parallel.dynamic_batch: does not combine"),
    (dict(ps_servers=1), "parallel.ps_servers=1: does not combine"),
    (dict(fault_tolerance="torchft", dp=2), "parallel.fault_tolerance=torchft: does not combine"),
])
def test_compositions_not_built_with_cp_are_refused(keys, fragment):
    assert any(p.startswith(fragment) for p in parallel_problems(_recipe(cp=2, **keys))), \
        parallel_problems(_recipe(cp=2, **keys))


def test_zero_lora_compile_fp8_and_the_fused_loss_are_accepted_with_cp():
    lora = _recipe(cp=2, model=ModelConfig(**{**LLAMA.__dict__, "lora_rank": 4}))
    assert parallel_problems(lora) == []
    assert all(parallel_problems(_recipe(cp=2, zero=z)) == [] for z in (1, 2, 3))
    compiled = Recipe(model=LLAMA, parallel=ParallelConfig(cp=2), train=TrainConfig(seq_len=32, compile=True))
    assert parallel_problems(compiled) == []
    fp8 = Recipe(model=LLAMA, parallel=ParallelConfig(cp=2), train=TrainConfig(seq_len=32, precision="fp8"))
    assert parallel_problems(fp8) == []  # its amaxes over tokens are reduced over cp (test_fp8_context_parallel)
    fused = Recipe(model=LLAMA, parallel=ParallelConfig(cp=2), train=TrainConfig(seq_len=32, fused_loss=True))
    assert parallel_problems(fused) == []  # a loss sum over this rank's tokens, as the unfused loss


def test_cli_refuses_a_seq_len_cp_cannot_split_in_one_line_with_exit_2(capsys, tmp_path):
    code = cli.main(["--recipe", TINY, "--set", "parallel.cp=2", "--set", "train.seq_len=30",
                     "--set", f"run.output_dir={tmp_path}", "--dry-run", "--nproc", "2"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "train.seq_len: must be divisible by 2*parallel.cp=4" \
        in err[0], err


def test_a_resume_counts_cp_in_the_saved_world_and_the_launch():
    """A cp 2 checkpoint on 2 ranks resumed on 2 ranks at cp 2 is not elastic; at cp 1 on 1 rank it is
    (the world changed), and the recipe's dp x tp x pp x cp must cover the launch."""
    saved = SavedLayout(path="ckpt", dp=1, tp=1, pp=1, cp=2, microbatches=1, global_batch=8)
    assert saved.world_size == 2
    assert not is_elastic(_recipe(cp=2), saved, 2)
    assert is_elastic(_recipe(), saved, 1)
    assert is_elastic(_recipe(cp=2, dp=1), SavedLayout(path="c", dp=2, tp=1, pp=1, microbatches=1, global_batch=8), 4)


def test_the_long_context_recipe_dry_runs_on_8_ranks_and_fits_80gb_cards(capsys, monkeypatch):
    """recipes/long-context.yaml (a 1.2B llama at 32k tokens, cp 4 x tp 2): the dry run accepts the layout
    and the planner's per-rank peak fits the card PIPETRAIN_DEVICE names (an 80 GB H100), not this host."""
    monkeypatch.setenv("PIPETRAIN_DEVICE", "h100-sxm-80gb")
    code = cli.main(["--recipe", os.path.join(ROOT, "recipes", "long-context.yaml"), "--dry-run", "--nproc", "8"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "cp=4" in out and "tp=2" in out and "8 x 32768" in out
    (verdict,) = [line for line in out.splitlines() if "largest predicted peak" in line]
    assert verdict.startswith("fits:") and "h100-sxm-80gb, from PIPETRAIN_DEVICE" in verdict, verdict
    # 16x the sequence on the same cards: refused in one line, against the same device
    code = cli.main(["--recipe", os.path.join(ROOT, "recipes", "long-context.yaml"), "--dry-run", "--nproc", "8",
                     "--set", "train.seq_len=524288", "--set", "model.max_seq_len=524288"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "80.0 GB is available (h100-sxm-80gb" in err[0], (code, err)
