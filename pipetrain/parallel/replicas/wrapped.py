"""WrappedOptimizer: the trainer's optimizer interface passed through to an inner optimizer.

The cross-replica wrappers (pipetrain.parallel.replicas.relaxed, pipetrain.parallel.replicas.failover) change how replicas
exchange gradients, not what happens inside one: they subclass this and override only what differs.
"""
from __future__ import annotations


class WrappedOptimizer:
    """zero_grad / reduce_grads / clip_grad_norm / step / state_items / load_state_items of self.inner,
    and any other attribute (stage, views, model, state_bytes, ...) read from it. Subclasses set
    self.inner in __init__."""

    def __getattr__(self, name):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def reduce_grads(self) -> None:
        """Sum gradients inside the replica (dp_shard, tp, tied embedding)."""
        self.inner.reduce_grads()

    def clip_grad_norm(self, max_norm: float) -> float:
        return self.inner.clip_grad_norm(max_norm)

    def step(self, lr: float) -> None:
        self.inner.step(lr)

    def state_items(self):
        return self.inner.state_items()

    def load_state_items(self, read) -> None:
        self.inner.load_state_items(read)
