"""Guarantees of checkpoints and relaxed replicas that the wider tests only check for self-consistency,
checked here against a hand computation or an uninterrupted run, without processes.

- DiLoCo's outer step is Nesterov SGD on the replicas' mean pseudo-gradient with outer_lr
  (docs/relaxed_sync.md): the checkpoint tests run DiLoCo with momentum, but only compare a run with
  itself, so a wrong formula or an ignored outer_lr keeps them green.
- SGD's momentum survives a checkpoint taken after the first step (the step counter is 1).
- DSSP applies an arrived update of clock c - staleness_min at clock c: the inclusive end of its window
  (c - staleness, c - staleness_min], which the scripted test in test_relaxed.py never reaches.
- Under checkpoint.async a save waits for the one still in flight (at most one at a time) instead of
  failing: the default tests only save again after an explicit wait().
- A resume into the same layout restores the CPU generator state the checkpoint saved (docs/checkpoints.md,
  "RNG streams"); the bitwise-resume tests compare losses, which no RNG draw touches.
"""
from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import numpy as np
import torch
from safetensors import safe_open

from pipetrain.build import build_trainer
from pipetrain.checkpoint.read import read_manifest
from pipetrain.config import CheckpointConfig, ParallelConfig, Recipe, RunConfig, TrainConfig
from pipetrain.data import Loader, PackedData
from pipetrain.models import build, materialize
from pipetrain.optim.build import Optimizer
from pipetrain.parallel.mesh.dims import ParallelDims
from pipetrain.parallel.replicas import periodic
from tests.unit.common import LLAMA, read_from
from tests.unit.test_relaxed import _relaxed


class _Inner:
    """The wrapped (inner) optimizer of one replica: plain SGD on a fixed gradient."""

    def __init__(self):
        self.model = torch.nn.Linear(3, 2, bias=False)
        with torch.no_grad():
            self.model.weight.copy_(torch.arange(6.0).reshape(2, 3) / 10)
        self.grad = torch.tensor([[1.0, -2.0, 0.5], [0.25, 3.0, -1.0]])
        self.steps_taken = 0

    def clip_grad_norm(self, max_norm: float) -> float:
        return 0.0

    def step(self, lr: float) -> None:
        with torch.no_grad():
            self.model.weight.sub_(lr * self.model.weight.grad)
        self.steps_taken += 1


def test_diloco_outer_step_is_nesterov_sgd_on_the_mean_pseudo_gradient_with_outer_lr(monkeypatch):
    """Two outer steps (sync_every 1) of replica 0 of 2, the peer's pseudo-gradient scripted into the
    all-reduce: the global params follow m <- mu m + d, g <- g - outer_lr (d + mu m) with d the mean of the
    two replicas' pseudo-gradients; every replica then holds g. The second step exercises the momentum."""
    peer = torch.tensor([0.3, -0.1, 0.2, 0.05, -0.4, 0.1])  # the other replica's pseudo-gradient (flat)

    def all_reduce_(flat, group):  # the sum over both replicas
        flat.add_(peer)
    monkeypatch.setattr(periodic, "all_reduce_", all_reduce_)
    dims = SimpleNamespace(dp_replicate=2, dp_replicate_group="replicate", dp_replicate_rank=0, dp_shard_rank=0,
                           device=torch.device("cpu"))
    mu, outer_lr, lr = 0.9, 0.7, 0.1
    pcfg = ParallelConfig(dp_sync="diloco", sync_every=1, outer_lr=outer_lr, outer_momentum=mu)
    inner = _Inner()
    opt = periodic.PeriodicSyncOptimizer(inner, dims, pcfg, TrainConfig())
    w = inner.model.weight
    g, m = w.detach().clone().reshape(-1), torch.zeros(6)
    for clock in (1, 2):
        w.grad = inner.grad.clone()
        opt.sync_step(clock, lambda k: lr, 0.0, lambda norm: None)
        own = (2 * lr) * inner.grad.reshape(-1)  # the replica's step on its own mean gradient (scaled by R = 2)
        d = (own + peer) / 2
        m = mu * m + d
        g = g - outer_lr * (d + mu * m)
        torch.testing.assert_close(opt.global_params[0].reshape(-1), g, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(w.detach().reshape(-1), g, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.outer_momentum[0].reshape(-1), m, rtol=1e-6, atol=1e-7)


def test_dssp_applies_an_arrived_update_at_the_lower_staleness_bound(monkeypatch):
    """staleness 3, staleness_min 1: at clock c the window of early updates ends at c - 1 inclusive, so a
    complete exchange of clock c - 1 is applied at c, with its own clock's lr."""
    opt, works, _, step = _relaxed(monkeypatch)
    assert step(1, 0.1)["applied"] == []    # clock 1 > 1 - 1: outside the window
    works[1].done = True
    assert step(2, 1.1)["applied"] == [1]   # clock 1 = 2 - staleness_min, arrived: applied now
    works[2].done = True
    assert step(3, 2.1)["applied"] == [2]   # and clock 2 at clock 3; clock 3 itself is outside the window
    assert opt.wrapped.lrs == [0.01, 0.02]


def _sgd_model():
    model = build(LLAMA, device="meta")
    materialize(model, LLAMA, 0, torch.device("cpu"))
    return model


def test_sgd_momentum_saved_after_the_first_step_resumes_exactly():
    """SGD with momentum, a checkpoint (state_items) after exactly one step, loaded into a fresh optimizer
    over a copy of the weights: the next step equals the uninterrupted run's. The step counter there is 1,
    the boundary of "momentum exists"."""
    torch.manual_seed(0)
    cfg = TrainConfig(optimizer="sgd", momentum=0.9, weight_decay=0.0, lr=0.1)
    ids = torch.randint(0, 64, (2, 8))

    def step(model, opt):
        opt.zero_grad()
        model(ids).square().mean().backward()
        opt.step(0.1)

    straight = _sgd_model()
    opt = Optimizer(straight, ParallelDims(), cfg)
    step(straight, opt)
    items = opt.state_items()
    resumed = _sgd_model()
    resumed.load_state_dict(straight.state_dict())
    fresh = Optimizer(resumed, ParallelDims(), cfg)
    fresh.load_state_items(read_from(items))
    step(straight, opt)
    step(resumed, fresh)
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def _trainer(out, resume=None, is_async=False):
    recipe = Recipe(model=LLAMA, parallel=ParallelConfig(),
                    train=TrainConfig(steps=4, global_batch=4, seq_len=16, lr=1e-2, warmup_steps=1),
                    checkpoint=CheckpointConfig(async_=is_async), run=RunConfig(output_dir=str(out), progress=False))
    os.makedirs(out, exist_ok=True)
    tokens = np.random.default_rng(0).integers(0, LLAMA.vocab_size, 64 * 17).astype(np.int32)
    return build_trainer(recipe, loader=Loader(PackedData(tokens, None, 16, 0.0, 2), 4, 0, 1), resume=resume)


def test_same_layout_resume_restores_the_saved_cpu_generator_state(tmp_path):
    """docs/checkpoints.md: with the same layout each rank's CPU generator state is restored. After a resume
    the generator is where the saving run's was at the save (the state in rank 0's file), so the next
    draw is the saving run's next draw, whatever the process drew before."""
    trainer = _trainer(tmp_path / "run")
    trainer.train_step()
    torch.manual_seed(123)  # a state no fresh process would have
    path = trainer.checkpointer.save(trainer)
    expected = torch.rand(4)
    with safe_open(os.path.join(path, "rank-00000.safetensors"), "pt") as f:
        saved = f.get_tensor("rng/cpu")
    torch.manual_seed(0)
    _trainer(tmp_path / "run", resume=path)
    assert torch.equal(torch.get_rng_state(), saved)
    assert torch.equal(torch.rand(4), expected)


def test_an_async_save_while_one_is_in_flight_waits_for_it(tmp_path):
    """The first background write is held until someone waits for it; the next step's save() must wait for it
    (which lets it go) and then write its own checkpoint, both complete and in order. A save that does not wait
    finds the first still in flight."""
    trainer = _trainer(tmp_path / "run", is_async=True)
    ckpt = trainer.checkpointer
    release = threading.Event()
    write, wait = ckpt.writer._write_rank_file, ckpt.writer.wait

    def held_write(path, snap):
        assert release.wait(600), "the first write was never released"
        write(path, snap)

    def releasing_wait():
        release.set()
        wait()
    ckpt.writer._write_rank_file, ckpt.writer.wait = held_write, releasing_wait
    trainer.train_step()
    first = ckpt.save(trainer)
    trainer.train_step()
    assert ckpt.in_flight, ckpt.writer._outcome  # the first is still held here (else: what ended it)
    second = ckpt.save(trainer)
    ckpt.wait()
    assert ckpt.writer.events == [("snapshot", 1), ("written", 1), ("snapshot", 2), ("written", 2)]
    assert read_manifest(first)["step"] == 1 and read_manifest(second)["step"] == 2
