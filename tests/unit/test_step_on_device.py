"""The step that never waits for the host mid-way (pipetrain.optim.build.Optimizer.clip_and_step): with torch's
fused AdamW the global norm, the clip and the divergence check stay on the device, and the loss and norm are
read once, after the update is queued. On a GPU that is the fused path of every run with parallel.zero 0 and
no relaxed sync or parameter server; here the CPU's fused AdamW runs the same code (FUSED_DEVICES)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import pipetrain.optim.adamw as adamw
from pipetrain.trainer import TrainingDiverged
from tests.unit.common import LLAMA, build_trainer


@pytest.fixture
def fused_on_cpu(monkeypatch):
    monkeypatch.setattr(adamw, "FUSED_DEVICES", ("cuda", "cpu"))


def _trainer(tmp_path, name: str, **kwargs):
    (tmp_path / name).mkdir()
    return build_trainer(LLAMA, str(tmp_path / name), **kwargs)


def _losses(tmp_path, name: str, grad_clip: float, steps: int = 5):
    trainer = _trainer(tmp_path, name, learnable=True, steps=steps, grad_clip=grad_clip)
    records = [trainer.train_step() for _ in range(steps)]
    return trainer, [r["loss"] for r in records], [r["grad_norm"] for r in records]


@pytest.mark.parametrize("grad_clip", [0.5, 0.0, 100.0])
def test_the_step_on_the_device_gives_the_host_paths_losses_and_norms(tmp_path, monkeypatch, grad_clip):
    """The host path (foreach AdamW, norm read before the step, gradients multiplied by the clip) against the
    device path (fused AdamW dividing by clip_divisor): the same run to round-off, clipping or not."""
    host, host_losses, host_norms = _losses(tmp_path, "host", grad_clip)
    assert not host.optimizer.steps_on_device
    monkeypatch.setattr(adamw, "FUSED_DEVICES", ("cuda", "cpu"))
    device, device_losses, device_norms = _losses(tmp_path, "device", grad_clip)
    assert device.optimizer.steps_on_device
    if grad_clip == 0.5:  # the clip must act for the comparison to test it
        assert all(n > grad_clip for n in host_norms[:3]), host_norms
    torch.testing.assert_close(device_losses, host_losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(device_norms, host_norms, rtol=1e-5, atol=0)
    assert device_losses[-1] < 0.9 * device_losses[0]  # and it trains


class _Ops(TorchDispatchMode):
    """The aten ops a step dispatches, with the dtype of each read to the host (_local_scalar_dense: item(),
    float(), int() of a tensor)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        self.ops.append((name, args[0].dtype if name == "_local_scalar_dense" else None))
        return func(*args, **(kwargs or {}))


def _float_reads_before_the_update(ops) -> int:
    """Reads of floating-point tensors to the host before the optimizer's update (fused or foreach) is queued.
    Integer reads are the target counts, taken from the CPU batch (free on a GPU run too)."""
    update = next(i for i, (name, _) in enumerate(ops) if name in ("_fused_adamw_", "_foreach_lerp_"))
    return sum(1 for name, dtype in ops[:update] if name == "_local_scalar_dense" and dtype.is_floating_point)


def test_the_device_path_reads_nothing_to_the_host_before_the_update(tmp_path, monkeypatch):
    counts = {}
    for path in ("host", "device"):
        if path == "device":
            monkeypatch.setattr(adamw, "FUSED_DEVICES", ("cuda", "cpu"))
        trainer = _trainer(tmp_path, path, steps=3)
        trainer.train_step()  # the first step creates the optimizer state
        with _Ops() as mode:
            trainer.train_step()
        counts[path] = _float_reads_before_the_update(mode.ops)
    assert counts["host"] >= 1  # the probe sees the host path's read of the norm
    assert counts["device"] == 0, counts


def test_a_non_finite_loss_skips_the_update_on_the_device_and_raises(tmp_path, fused_on_cpu):
    trainer = _trainer(tmp_path, "run", steps=3)
    trainer.train_step()
    with torch.no_grad():  # a weight gone bad: the loss and every gradient become NaN
        dict(trainer.model.named_parameters())["layers.0.attn.wq.weight"][0, 0] = float("nan")
    opt = trainer.optimizer.torch_opt
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    with pytest.raises(TrainingDiverged, match="loss is nan and grad norm nan at step 2"):
        trainer.train_step()
    for n, p in trainer.model.named_parameters():
        torch.testing.assert_close(p.detach(), params[n], rtol=0, atol=0, equal_nan=True, msg=n)
    for p, s in opt.state.items():  # moments and step counters as before the step
        for k, v in s.items():
            torch.testing.assert_close(v, state[id(p)][k], rtol=0, atol=0)


def test_every_batch_tensor_the_executor_hands_a_layer_went_through_to_device(tmp_path, monkeypatch):
    """Positions (document masking, cp) reach every layer: the executor moves them once per microbatch with
    to_device (pinned, non_blocking on a GPU). A layer's own positions.to("cuda") from pageable memory was a
    blocking copy, two host waits per attention layer (tests/gpu checks it with CUDA's sync debug mode)."""
    import pipetrain.parallel.pipeline.executor as executor
    moved = []
    real = executor.to_device
    monkeypatch.setattr(executor, "to_device", lambda t, device: moved.append(t) or real(t, device))
    trainer = _trainer(tmp_path, "positions")
    next_batch = trainer.loader.next

    given = []

    def with_positions():
        batch, num_targets = next_batch()
        batch.positions = (torch.arange(batch.inputs.shape[1]) % 5).expand_as(batch.inputs).contiguous()
        given.append(batch.positions)
        return batch, num_targets
    monkeypatch.setattr(trainer.loader, "next", with_positions)
    trainer.train_step()
    assert given and any(t.data_ptr() == given[0].data_ptr() for t in moved), \
        "the positions never went through to_device"
