"""Expert parallelism under HSDP (parallel.ep with parallel.dp_shard < dp) matches one process at every step.

dp = dp_replicate x dp_shard with ep dividing dp_shard: each replica holds every expert, an ep group lies inside
one replica, and ZeRO shards the dense rows over dp_shard and the expert rows over the replica's holders of the
same experts (dims.expert_zero_shard: dp_shard / ep ranks). The replica wrapper (ReplicaOptimizer) then sums each
rank's rows of both parts over dp_replicate. Checked: the loss, aux loss, gradient norm and expert loads at every
step, the aux-free biases, the final weights and the moments' bytes against plan.memory; the checkpoint resumes
the run exactly and loads into one process with the run's next two losses and norms (the second reads the
restored moments). A dynamic batch (parallel.dynamic_batch) moves microbatches between the replicas while each
ep group, inside one replica, runs one count: the single process's loss at every step.

By default dp 4 = 2 x 2 at ep 2 under ZeRO 1 (one holder of each expert per replica) and dp 8 = 2 x 4 at ep 2 under
ZeRO 3 (the expert rows shard, gather and reduce-scatter over 2 ranks of each replica); the other stages slow."""
from __future__ import annotations

import os

import pytest
import torch

from pipetrain.models import param_layout
from pipetrain.models.moe import moe_layers
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.replicas.wrapped import ReplicaOptimizer
from pipetrain.plan.memory import model_state_bytes
from tests.dist.common import replica_trainer
from tests.dist.test_dbs import LAYOUT_AFTER_ADAM, SLOW
from tests.dist.test_moe import MOE
from tests.dist.test_zero3 import AFTER_ADAM
from tests.harness import EXACT_FP32, rank_results, run_ranks
from tests.unit.common import build_trainer

STEPS = 4
SAVE_AT = 2  # two steps after it: the second reads the AdamW moments the checkpoint restored
DBS_STEPS = 8  # tests/dist/test_dbs.py's: the split moves after two windows of two steps
KEYS = ("loss", "aux_loss", "grad_norm")


def _reference(out, global_batch):
    """One process: per step the metrics; then the weights and the aux-free biases."""
    os.makedirs(out, exist_ok=True)
    trainer = build_trainer(MOE, out, steps=STEPS, global_batch=global_batch, seq_len=16)
    history = []
    for _ in range(STEPS):
        record = trainer.train_step()
        history.append({k: record[k] for k in KEYS + ("expert_load_max",)})
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    bias = {i: m.router.expert_bias.clone() for i, m in moe_layers(trainer.model).items()}
    return history, params, bias


def _weights(trainer) -> dict[str, torch.Tensor]:
    """This rank's whole local parameters (ZeRO-3 gathers its rows)."""
    opt = trainer.optimizer
    if hasattr(opt, "full_params"):
        return opt.full_params()
    return {n: p.detach() for n, p in trainer.model.named_parameters()}


def _worker(rank, world_size, out, degrees, zero, global_batch, expected):
    history, params, bias = expected
    dims = ParallelDims.from_degrees(**degrees)
    keys = dict(steps=STEPS, global_batch=global_batch, seq_len=16, zero=zero, ep=dims.ep, dp_shard=dims.dp_shard)
    trainer = build_trainer(MOE, out, dims, **keys)
    opt = trainer.optimizer
    assert isinstance(opt, ReplicaOptimizer), type(opt)
    # the dense rows shard over dp_shard, the expert rows over this replica's holders of the same experts
    assert (opt.dense.dp_size, opt.experts.dp_size) == (dims.dp_shard, dims.dp_shard // dims.ep)
    after = []  # (loss, grad norm) of the steps after SAVE_AT
    for step in range(STEPS):
        got = trainer.train_step()
        if step >= SAVE_AT:
            after.append((got["loss"], got["grad_norm"]))
        for key in KEYS:
            torch.testing.assert_close(got[key], history[step][key], **EXACT_FP32,
                                       msg=f"{dims.coords} step {step + 1} {key}")
        assert got["expert_load_max"] == history[step]["expert_load_max"], f"{dims.coords} step {step + 1} load"
        if step == SAVE_AT - 1:
            trainer.checkpointer.save(trainer)
    # plan.memory's count of dp rank 0's AdamW moments (the most rows): dp_shard's dense rows, dp_shard / ep's experts
    modeled = model_state_bytes(trainer.recipe, world_size, dims.pp_rank)[2]
    assert opt.state_bytes() == modeled if dims.dp_rank == 0 else opt.state_bytes() <= modeled, (opt.state_bytes(),
                                                                                               modeled)
    mine = _weights(trainer)
    for name, (_, slices) in param_layout(trainer.model).items():  # the experts: this ep rank's slice
        torch.testing.assert_close(mine[name], params[name][slices], **AFTER_ADAM, msg=f"{dims.coords} {name}")
    for i, m in moe_layers(trainer.model).items():
        torch.testing.assert_close(m.router.expert_bias, bias[i], rtol=0, atol=0, msg=f"{dims.coords} bias {i}")
    resumed = build_trainer(MOE, out, dims, resume=os.path.join(out, "checkpoints", f"step-{SAVE_AT:08d}"), **keys)
    again = [(r["loss"], r["grad_norm"]) for r in (resumed.train_step() for _ in range(STEPS - SAVE_AT))]
    assert again == after, f"{dims.coords} the HSDP checkpoint resumes exactly: {again} != {after}"


def _matches_single_process(tmp_path, dp, dp_shard, zero):
    global_batch = max(4, dp)
    expected = _reference(str(tmp_path / "one"), global_batch)
    out = str(tmp_path / "hsdp")
    os.makedirs(out)
    run_ranks(dp, _worker, out, dict(dp=dp, ep=2, dp_shard=dp_shard), zero, global_batch, expected)
    # its checkpoint (one replica's row boxes) loads into one process: the same next loss
    os.makedirs(tmp_path / "one_resumed")
    one = build_trainer(MOE, str(tmp_path / "one_resumed"), steps=STEPS, global_batch=global_batch, seq_len=16,
                        resume=os.path.join(out, "checkpoints", f"step-{SAVE_AT:08d}"))
    for step in range(SAVE_AT, STEPS):
        got = one.train_step()
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(got[key], expected[0][step][key], **EXACT_FP32, msg=f"step {step + 1} {key}")


@pytest.mark.parametrize("dp, dp_shard, zero", [(4, 2, 1), (8, 4, 3)], ids=["dp4-shard2-zero1", "dp8-shard4-zero3"])
def test_ep2_under_hsdp_matches_single_process(tmp_path, dp, dp_shard, zero):
    _matches_single_process(tmp_path, dp, dp_shard, zero)


@pytest.mark.slow
@pytest.mark.parametrize("dp, dp_shard, zero", [(4, 2, 3), (8, 4, 1), (8, 4, 2)],
                         ids=["dp4-shard2-zero3", "dp8-shard4-zero1", "dp8-shard4-zero2"])
def test_ep2_under_hsdp_layouts_match_single_process(tmp_path, dp, dp_shard, zero):
    _matches_single_process(tmp_path, dp, dp_shard, zero)


def _dbs_worker(rank, world_size, out):
    """One process, then dp 4 = 2 replicas x dp_shard 2 at ep 2 under ZeRO 1 with a dynamic batch, the last rank
    slowed by injected faults: (the reference losses, the run's losses, its per-step replica shares)."""
    torch.manual_seed(0)
    keys = dict(model=MOE, microbatches=2)
    for name in (f"one{rank}", "hsdp"):
        os.makedirs(os.path.join(out, name), exist_ok=True)
    ref = replica_trainer(os.path.join(out, f"one{rank}"), ParallelDims(), steps=DBS_STEPS, **keys)
    want = [ref.train_step()["loss"] for _ in range(DBS_STEPS)]
    dims = ParallelDims.from_degrees(dp_shard=2, ep=2)
    trainer = replica_trainer(os.path.join(out, "hsdp"), dims, steps=DBS_STEPS, ep=2, dp_shard=2, zero=1,
                              dynamic_batch=True, dynamic_batch_every=2, faults=SLOW, **keys)
    losses, shares = [], []
    for _ in range(DBS_STEPS):
        record = trainer.train_step()
        trainer.agree()
        losses.append(record["loss"])
        shares.append(record["dbs_shares"])
    return want, losses, shares


def test_ep2_under_hsdp_with_a_dynamic_batch_gives_the_single_process_loss(tmp_path):
    """Each ep group lies inside one replica, so its ranks run the same microbatch count while the split moves
    microbatches between the replicas (from 4 + 4 to fewer on the slowed one): the all-to-alls pair up, and the
    loss is the single process's at every step."""
    for want, losses, shares in rank_results(4, _dbs_worker, str(tmp_path)):
        torch.testing.assert_close(losses[0], want[0], **EXACT_FP32)
        torch.testing.assert_close(losses, want, **LAYOUT_AFTER_ADAM)
        assert shares[0] == [4, 4] and all(sum(s) == 8 for s in shares), shares
        assert shares[-1][-1] < 4, shares  # the slowed replica (the last) gave microbatches away
