"""ZeRO 1/2 on gloo CPU processes: every stage reproduces zero 0 (and zero 0 the single process) in
losses, gradient norms and parameters; per-rank state bytes follow the ZeRO formula exactly; the
state boxes tile the global tensors and reload from any layout; bf16 and recomputation work across
tp and pp; a microbatch count that moves between steps (a dynamic batch) keeps the overlapped reduction
exact; and train.py runs ZeRO end to end.

Spawning processes dominates the cost on the shared CPU machine, so one world of 4 runs every
in-process case once (dp 4, dp 2 x tp 2 with sequence parallelism, dp 2 x pp 2 interleaved with a
tied embedding) and records measurements; the tests below each check one claim against them.
"""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from pipetrain.config import TrainConfig
from pipetrain.models import param_layout
from pipetrain.optim.build import Optimizer, lr_at
from pipetrain.optim.adamw import MOMENTS
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.data.zero import ZeroOptimizer
from tests.e2e.common import run_train, step_losses
from tests.harness import EXACT_FP32, TP_FP32, rank_results, run_ranks
from tests.unit.common import BF16_LOSS, GPT2, LLAMA, build_trainer, read_from, zero_formula_bytes

GPT4 = dataclasses.replace(GPT2, n_layers=4)
STEPS, BUCKET_BYTES = 3, 4096  # small buckets: several per rank, so ordering and overlap are exercised
LAYOUTS = {  # name: (model, tp, pp, parallel kwargs); every layout runs 2 microbatches (accumulation)
    "dp4": (LLAMA, 1, 1, {}),
    "dp2_tp2_sp": (LLAMA, 2, 1, {"sequence_parallel": True}),  # tp shards + tp-partial norms (late buckets)
    # tied head copy on the last stage; two chunks per rank interleave their backward passes; split
    # backward: deferred weight gradients meet ZeRO-2's accumulate hooks, recomputation and bf16
    "dp2_pp2_interleaved": (GPT4, 1, 2, {"schedule": "interleaved-1f1b", "virtual_stages": 2,
                                         "split_backward": True}),
}
COMMON = dict(microbatches=2, grad_clip=0.5, steps=STEPS)  # grad norms ~0.75: clipping is active


def _train(cfg, out, dims, zero=0, **kw):
    trainer = build_trainer(cfg, out, dims, zero=zero, bucket_bytes=BUCKET_BYTES if zero else None,
                            **{**COMMON, **kw})
    records = [trainer.train_step() for _ in range(STEPS)]
    return trainer, [r["loss"] for r in records], [r["grad_norm"] for r in records]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _moments(opt: ZeroOptimizer) -> dict[str, torch.Tensor]:
    """Every moment the optimizer steps, the tied head copy included (state_items leaves it out)."""
    return {f"{m}/{opt.shards[i].name}": opt.torch_opt.state[view][m] for i, view in opt.views.items() for m in MOMENTS}


def _layout_worker(name, dims, out) -> dict:
    cfg, tp, pp, extra = LAYOUTS[name]
    ref, ref_losses, ref_norms = _train(cfg, out, ParallelDims())  # the single process, same batches
    ref_params = dict(ref.model.named_parameters())
    ref_items = ref.optimizer.state_items()
    runs = {z: _train(cfg, out, dims, z, **extra) for z in (0, 1, 2)}
    zero0 = runs[0][0]
    zero0_state = {n: (t, off) for n, t, _, off in zero0.optimizer.state_items()}
    local = sum(p.numel() for p in zero0.model.parameters())
    rec = {"coords": [dims.tp_rank, dims.pp_rank], "dp": dims.dp, "ref_losses": ref_losses, "ref_norms": ref_norms,
           "losses": {}, "norms": {}, "param_diff": {}, "ref_param_diff": {}, "state_bytes": {},
           "formula_bytes": 2 * 4 * local // dims.dp, "state_diff": {}, "state_numel": {}, "reload_diff": {},
           "zero0_numel": sum(t.numel() for n, (t, _) in zero0_state.items() if n != "step")}
    for z, (trainer, losses, norms) in runs.items():
        rec["losses"][z], rec["norms"][z] = losses, norms
        params = dict(trainer.model.named_parameters())
        rec["param_diff"][z] = max(_max_diff(p, dict(zero0.model.named_parameters())[n]) for n, p in params.items())
        layout = param_layout(trainer.model)
        rec["ref_param_diff"][z] = max(
            _max_diff(params[n], ref_params["embed.weight" if n == "head.weight" and cfg.tied else n][sl])
            for n, (_, sl) in layout.items())
        rec["state_bytes"][z] = trainer.optimizer.state_bytes()
        items = trainer.optimizer.state_items()
        rec["state_numel"][z] = sum(t.numel() for n, t, _, _ in items if n != "step")
        # each box equals the same region of zero 0's (tp-shard) tensor
        diffs = [0.0]
        for n, t, _, off in items:
            if n != "step":
                base, base_off = zero0_state[n]
                box = tuple(slice(o - b, o - b + s) for o, b, s in zip(off, base_off, t.shape))
                diffs.append(_max_diff(t, base[box]))
        rec["state_diff"][z] = max(diffs)
        if z:  # the single process's whole tensors, loaded as this layout's boxes, equal the trained state
            fresh = build_trainer(cfg, out, dims, zero=z, bucket_bytes=BUCKET_BYTES, **{**COMMON, **extra})
            fresh.optimizer.load_state_items(read_from(ref_items))
            loaded, trained = _moments(fresh.optimizer), _moments(trainer.optimizer)
            assert loaded.keys() == trained.keys(), f"{dims.coords} {sorted(loaded)} != {sorted(trained)}"
            rec["reload_diff"][z] = max([_max_diff(loaded[n], trained[n]) for n in trained] + [0.0])
            rec["reload_steps"] = fresh.optimizer.steps_taken
    if tp > 1 or pp > 1:  # recompute and bf16 across tp / pp
        for mode in ("selective", "full"):
            trainer, losses, _ = _train(cfg, out, dims, 0, recompute=mode, **extra)
            rec.setdefault("recompute_loss_diff", {})[mode] = max(abs(a - b) for a, b in zip(losses, runs[0][1]))
            rec.setdefault("recompute_param_diff", {})[mode] = max(
                _max_diff(p, q) for p, q in zip(trainer.model.parameters(), zero0.model.parameters()))
        _, bf16_losses, bf16_norms = _train(cfg, out, dims, 1, precision="bf16", **extra)
        rec["bf16_losses"], rec["bf16_norms"] = bf16_losses, bf16_norms
    return rec


class _Toy(nn.Module):
    """Parameters with fewer rows than dp=4 (some ranks own nothing) and uneven row splits."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.embed = nn.Embedding(6, 5)  # rows split 2/2/1/1, no weight decay
        self.proj = nn.Linear(5, 3)      # weight rows 1/1/1/0, bias 1/1/1/0
        self.out = nn.Linear(3, 2)       # weight rows 1/1/0/0
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))

    def forward(self, ids):
        return self.out(torch.tanh(self.proj(self.embed(ids))))


def _toy_worker(dims) -> dict:
    cfg = TrainConfig(steps=STEPS, lr=0.1, warmup_steps=0)
    ids = torch.randint(0, 6, (8, 4), generator=torch.Generator().manual_seed(1))
    rec = {}
    for kind in ("ref", "zero2"):
        model = _Toy()
        opt = Optimizer(model, ParallelDims(), cfg) if kind == "ref" else ZeroOptimizer(model, dims, cfg, stage=2,
                                                                                          bucket_bytes=64)
        mine = ids if kind == "ref" else ids.chunk(dims.dp)[dims.dp_rank]
        norms = []
        for step in range(STEPS):
            opt.zero_grad()
            for mb in mine.chunk(2):  # two accumulations: overlap must wait for the second
                (model(mb).square().sum() / ids.numel()).backward()
            opt.reduce_grads()
            norms.append(opt.clip_grad_norm(0.3))
            opt.step(lr_at(step + 1, cfg))
        rec[kind] = {"norms": norms, "params": [p.detach().clone() for p in model.parameters()], "opt": opt}
    zero = rec["zero2"]["opt"]
    return {"norms": rec["zero2"]["norms"], "ref_norms": rec["ref"]["norms"],
            "param_diff": max(_max_diff(a, b) for a, b in zip(rec["zero2"]["params"], rec["ref"]["params"])),
            "state_bytes": zero.state_bytes(), "expected_state_bytes": zero_formula_bytes(zero),
            "owned_rows": [s.rows[dims.dp_rank][1] - s.rows[dims.dp_rank][0] for s in zero.shards],
            "buckets": len(zero.buckets)}


MOVING = [2, 3, 1]  # microbatches per step, as a dynamic batch moves a replica's count between steps


def _toy_moving_worker(dims) -> dict:
    """ZeRO 1 and 2 told a different microbatch count each step (set_microbatches) against AdamW in one
    process; then a step that runs one backward pass more than it was told."""
    cfg = TrainConfig(steps=len(MOVING), lr=0.1, warmup_steps=0)
    ids = torch.randint(0, 6, (4 * 6, 4), generator=torch.Generator().manual_seed(2))  # 6 sequences per rank
    rec = {}
    for kind in ("ref", 1, 2):
        model = _Toy()
        opt = Optimizer(model, ParallelDims(), cfg) if kind == "ref" else ZeroOptimizer(model, dims, cfg, stage=kind,
                                                                                          bucket_bytes=64)
        mine = ids if kind == "ref" else ids.chunk(dims.dp)[dims.dp_rank]
        norms, in_backward = [], []
        for step, k in enumerate(MOVING):
            opt.zero_grad()
            if kind != "ref":
                opt.set_microbatches(k)
            for mb in mine.chunk(k):
                (model(mb).square().sum() / ids.numel()).backward()
            if kind != "ref":  # early buckets the hooks launched during backward
                in_backward.append(opt._next_launch)
            opt.reduce_grads()
            norms.append(opt.clip_grad_norm(0.3))
            opt.step(lr_at(step + 1, cfg))
        rec[kind] = {"norms": norms, "in_backward": in_backward,
                     "params": [p.detach().clone() for p in model.parameters()]}
        if kind != "ref":
            rec[kind]["num_early"] = opt.num_early
            opt.zero_grad()
            opt.set_microbatches(1)
            try:
                for mb in mine.chunk(2):
                    model(mb).square().sum().backward()
                rec[kind]["extra_backward"] = "no error"
            except RuntimeError as exc:
                rec[kind]["extra_backward"] = str(exc)
            opt.zero_grad()  # drains the reductions the first backward launched
    return {str(z): {"norms": rec[z]["norms"], "ref_norms": rec["ref"]["norms"], "in_backward": rec[z]["in_backward"],
                     "num_early": rec[z]["num_early"], "extra_backward": rec[z]["extra_backward"],
                     "param_diff": max(_max_diff(a, b) for a, b in zip(rec[z]["params"], rec["ref"]["params"]))}
            for z in (1, 2)}


def _world4_worker(rank, world_size, out):
    torch.manual_seed(0)
    out = os.path.join(out, f"rank{rank}")  # each Trainer opens its metrics file here
    os.makedirs(out)
    results = {"toy": _toy_worker(ParallelDims.from_degrees(tp=1, pp=1)),
               "toy_moving": _toy_moving_worker(ParallelDims.from_degrees(tp=1, pp=1))}
    for name, (_, tp, pp, _) in LAYOUTS.items():
        dims = ParallelDims.from_degrees(tp=tp, pp=pp)
        results[name] = _layout_worker(name, dims, out)
    dist.barrier()
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("zero-world4"))
    run_ranks(4, _world4_worker, out)
    ranks = []
    for r in range(4):
        with open(os.path.join(out, f"rank{r}", "results.json")) as f:
            ranks.append(json.load(f))
    return ranks


# Against the single process after a few AdamW steps: an element whose gradient is near round-off
# gets an update of about lr whose sign follows that round-off, so losses drift by ~1e-5 relative.
LAYOUT_AFTER_ADAM = dict(rtol=1e-4, atol=1e-5)


# ---- parity ----

@pytest.mark.parametrize("name", list(LAYOUTS))
def test_zero_1_and_2_match_zero_0_losses_norms_and_parameters(world4, name):
    for rank, res in enumerate(world4):
        rec = res[name]
        for z in ("1", "2"):
            torch.testing.assert_close(rec["losses"][z], rec["losses"]["0"], **EXACT_FP32)
            torch.testing.assert_close(rec["norms"][z], rec["norms"]["0"], **EXACT_FP32)
            assert rec["param_diff"][z] < 1e-5, (rank, z, rec["param_diff"][z])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_zero_stage_matches_the_single_process_run(world4, name):
    for rank, res in enumerate(world4):
        rec = res[name]
        for z in ("0", "1", "2"):
            tol = TP_FP32 if LAYOUTS[name][1] > 1 else EXACT_FP32
            torch.testing.assert_close(rec["losses"][z][0], rec["ref_losses"][0], **tol)  # before any update
            torch.testing.assert_close(rec["norms"][z][0], rec["ref_norms"][0], **tol)
            torch.testing.assert_close(rec["losses"][z], rec["ref_losses"], **LAYOUT_AFTER_ADAM)
            torch.testing.assert_close(rec["norms"][z], rec["ref_norms"], **LAYOUT_AFTER_ADAM)
            assert rec["ref_param_diff"][z] < 1e-4, (rank, z, rec["ref_param_diff"][z])


def test_uneven_rows_and_empty_shards_step_like_adamw(world4):
    for rank, res in enumerate(world4):
        toy = res["toy"]
        torch.testing.assert_close(toy["norms"], toy["ref_norms"], **EXACT_FP32)
        assert toy["norms"][0] > 0.3, "clipping at 0.3 must be active for the comparison to cover it"
        assert toy["param_diff"] < 1e-6, (rank, toy["param_diff"])
        assert toy["buckets"] > 1
    assert [res["toy"]["owned_rows"] for res in world4] == [[2, 1, 1, 1, 1], [2, 1, 1, 1, 1], [1, 1, 1, 0, 0],
                                                           [1, 0, 0, 0, 0]]


@pytest.mark.parametrize("zero", ["1", "2"])
def test_a_microbatch_count_that_moves_between_steps_steps_like_adamw(world4, zero):
    """The overlapped reduction learns accumulations per microbatch at step 1 (2 microbatches) and waits for
    3, then 1: every early bucket still launches during backward, and the result is AdamW's."""
    for rank, res in enumerate(world4):
        toy = res["toy_moving"][zero]
        torch.testing.assert_close(toy["norms"], toy["ref_norms"], **EXACT_FP32)
        assert toy["param_diff"] < 1e-6, (rank, toy["param_diff"])
        assert toy["num_early"] > 1 and toy["in_backward"] == [0] + [toy["num_early"]] * (len(MOVING) - 1), toy
        assert "accumulated 2 times this step but 1 times were expected (1 microbatch(es))" in \
            toy["extra_backward"], toy["extra_backward"]


# ---- memory ----

@pytest.mark.parametrize("name", list(LAYOUTS))
def test_per_rank_optimizer_state_bytes_equal_the_zero_formula(world4, name):
    for res in world4:
        rec = res[name]
        assert rec["state_bytes"]["0"] == rec["formula_bytes"] * rec["dp"]  # zero 0: 2 x 4 bytes x local params
        assert rec["state_bytes"]["1"] == rec["state_bytes"]["2"] == rec["formula_bytes"], rec["state_bytes"]


def test_uneven_state_bytes_count_each_ranks_own_rows(world4):
    per_rank = [res["toy"]["state_bytes"] for res in world4]
    assert per_rank == [res["toy"]["expected_state_bytes"] for res in world4]
    assert per_rank == [8 * (2 * 5 + 5 + 1 + 3 + 1), 8 * (2 * 5 + 5 + 1 + 3 + 1), 8 * (5 + 5 + 1), 8 * 5]
    assert sum(per_rank) == 8 * (6 * 5 + 3 * 5 + 3 + 2 * 3 + 2)


# ---- checkpoint boxes ----

@pytest.mark.parametrize("name", list(LAYOUTS))
def test_state_boxes_tile_the_zero0_shards_with_the_same_values(world4, name):
    numels, zero0 = {}, {}  # per (tp, pp) coordinate: the dp ranks' box sizes, and zero 0's shard size
    for res in world4:
        rec = res[name]
        coords = tuple(rec["coords"])
        zero0[coords] = rec["zero0_numel"]
        for z in ("1", "2"):
            assert rec["state_diff"][z] < 1e-5, (z, rec["state_diff"][z])
            numels.setdefault((coords, z), []).append(rec["state_numel"][z])
    for (coords, z), sizes in numels.items():
        assert len(sizes) == world4[0][name]["dp"] and sum(sizes) == zero0[coords] > 0, (coords, z, sizes)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_state_saved_by_one_process_loads_into_the_sharded_layout(world4, name):
    for res in world4:
        rec = res[name]
        assert rec["reload_steps"] == STEPS
        for z in ("1", "2"):
            assert rec["reload_diff"][z] < 1e-4, (z, rec["reload_diff"][z])


# ---- recomputation and bf16 across tp and pp ----

@pytest.mark.parametrize("name", ["dp2_tp2_sp", "dp2_pp2_interleaved"])
def test_recompute_keeps_losses_and_parameters_bitwise_across_tp_and_pp(world4, name):
    for res in world4:
        rec = res[name]
        assert rec["recompute_loss_diff"] == {"selective": 0.0, "full": 0.0}
        assert rec["recompute_param_diff"] == {"selective": 0.0, "full": 0.0}


@pytest.mark.parametrize("name", ["dp2_tp2_sp", "dp2_pp2_interleaved"])
def test_bf16_with_zero1_trains_across_tp_and_pp_within_bf16_tolerance(world4, name):
    for res in world4:
        rec = res[name]
        torch.testing.assert_close(rec["bf16_losses"][0], rec["losses"]["0"][0], **BF16_LOSS)
        assert rec["bf16_losses"] != rec["losses"]["0"], "autocast did not change the computation"
        assert all(map(torch.isfinite, torch.tensor(rec["bf16_norms"])))


# ---- train.py end to end ----

E2E = ["train.steps=6", "run.eval_every=0"]
E2E_LOSS = dict(rtol=1e-4, atol=0.0)  # a different dp / microbatch split changes summation order only


@pytest.fixture(scope="module")
def single_reference(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("zero-single"))
    proc, metrics = run_train(out, E2E)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return step_losses(metrics)


@pytest.mark.slow  # train.py runs dp2 zero2 in the default run through the checkpoint resharding e2e test
def test_train_py_dp2_zero2_matches_single_process_losses(tmp_path, single_reference):
    proc, metrics = run_train(str(tmp_path), E2E + ["parallel.zero=2"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = step_losses(metrics)
    assert len(losses) == 6
    torch.testing.assert_close(losses, single_reference, **E2E_LOSS)


@pytest.mark.slow
def test_train_py_dp2_tp2_pp2_zero1_matches_single_process_losses(tmp_path, single_reference):
    proc, metrics = run_train(str(tmp_path), E2E + ["parallel.zero=1", "parallel.tp=2", "parallel.pp=2",
                                                    "parallel.microbatches=2"], nproc=8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = step_losses(metrics)
    assert len(losses) == 6
    torch.testing.assert_close(losses, single_reference, **TP_FP32)


@pytest.mark.slow  # tests/dist/test_dbs.py checks ZeRO under a moving split in the default run, in process
def test_train_py_zero2_over_dp_shard_with_a_dynamic_batch_matches_single_process_losses(tmp_path, single_reference):
    """The issue's reproduction: 2 replicas x dp_shard 2, a persistent straggler moves the split mid-run."""
    proc, metrics = run_train(str(tmp_path), E2E + ["parallel.zero=2", "parallel.dp_shard=2", "parallel.microbatches=2",
                                                    "parallel.dynamic_batch=true", "parallel.dynamic_batch_every=1",
                                                    "faults.slow_ranks=[3]", "faults.slow_factor=4"], nproc=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shares = [m["dbs_shares"] for m in metrics if "loss" in m]
    assert shares[0] == [4, 4] and shares[-1][1] < shares[-1][0], shares  # rank 3's replica gave samples away
    torch.testing.assert_close(step_losses(metrics), single_reference, **E2E_LOSS)


BIG_VOCAB = dataclasses.replace(LLAMA, vocab_size=8192, d_model=64, ffn_hidden=128)  # a (8192, 64) gradient


def _first_norm(rank, world_size, out, zero):
    trainer = build_trainer(BIG_VOCAB, out, ParallelDims.from_degrees(dp=world_size), steps=2, zero=zero,
                            global_batch=4, seq_len=16)
    return trainer.train_step()["grad_norm"]


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_gives_the_single_process_gradient_norm_bit_for_bit_at_a_real_vocabulary(tmp_path, zero):
    """ZeRO sums the squares of each half of the rows apart, one process of the whole (8192, 64) embedding
    gradient: the CPU's fp32 foreach norm drifted with a tensor's size, so the two were 8.6e-6 apart (and the
    clip scaled the update by them). Summed in fp64 (grads.sum_sq), the norms are the same bits."""
    os.makedirs(tmp_path / "one")
    one = build_trainer(BIG_VOCAB, str(tmp_path / "one"), steps=2, global_batch=4, seq_len=16).train_step()
    norms = rank_results(2, _first_norm, str(tmp_path), zero)
    assert norms == [one["grad_norm"]] * 2, (norms, one["grad_norm"])
