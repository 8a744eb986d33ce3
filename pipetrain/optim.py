"""AdamW with the usual no-decay groups; lr_at() forwards to pipetrain.lr_schedule.

Checkpoints see every optimizer alike through state_items() / load_state_items(read): each AdamW
moment is listed under "exp_avg/<global name>" and "exp_avg_sq/<global name>" as a box (offsets
along each dim) of the global tensor, plus the scalar "step". Here (parallel.zero = 0) a box is the
rank's whole tp shard; pipetrain.parallel.zero lists its dp row shards the same way. The fp32
parameters are the master weights (also under train.precision=bf16, which autocasts only compute),
so no separate master copy is listed.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn as nn

from pipetrain import lr_schedule
from pipetrain.config import TrainConfig
from pipetrain.models.init import TIED_ALIASES, param_layout

MOMENTS = ("exp_avg", "exp_avg_sq")
# read(name, global_shape, offsets, shape) -> the box of the global tensor this rank needs
ReadBox = Callable[[str, tuple, tuple, tuple], torch.Tensor]
# (global name, tensor the optimizer steps, global shape, offsets of that tensor in the global one)
StateEntry = tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]

_NO_DECAY_MODULES = ("embed", "pos_embed")


def decays(name: str, p: torch.Tensor, tied: bool = False) -> bool:
    """Weight decay applies to matrices, not to norms, biases or embeddings. With tied embeddings the
    last pipeline stage's head.weight is a copy of the embedding and must not decay either (else the
    two copies drift apart: the first stage's embed.weight does not decay)."""
    if tied:
        name = TIED_ALIASES.get(name, name)
    return p.dim() >= 2 and name.split(".")[0] not in _NO_DECAY_MODULES


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if decays(name, p, is_tied(model)) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_adamw(params_or_groups, cfg: TrainConfig) -> torch.optim.AdamW:
    # foreach keeps the per-parameter loop out of Python; fused is CUDA-only in some torch builds.
    fused = all(p.is_cuda for g in params_or_groups for p in (g["params"] if isinstance(g, dict) else [g]))
    return torch.optim.AdamW(params_or_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                             fused=fused or None, foreach=None if fused else True)


class Optimizer:
    """AdamW over this rank's parameters with replicated state (parallel.zero = 0).

    The trainer drives every optimizer the same way, so ZeRO (pipetrain.parallel.zero) is a drop-in:
    zero_grad(); backward...; reduce_grads(); clip_grad_norm(max_norm) -> global norm; step(lr).
    """

    def __init__(self, model: nn.Module, dims, cfg: TrainConfig):
        self.model, self.dims, self.cfg = model, dims, cfg
        self.inner = build_adamw(param_groups(model, cfg.weight_decay), cfg)
        self.steps_taken = 0

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def reduce_grads(self) -> None:
        from pipetrain.parallel.grads import sync_grads
        sync_grads(self.model, self.dims)

    def clip_grad_norm(self, max_norm: float) -> float:
        from pipetrain.parallel.grads import clip_grad_norm
        return clip_grad_norm(self.model, self.dims, max_norm)

    def step(self, lr: float) -> None:
        set_lr(self.inner, lr)
        self.inner.step()
        self.steps_taken += 1

    def _entries(self) -> list[StateEntry]:
        return [e for e in param_boxes(self.model) if e[1].requires_grad]

    def state_items(self) -> list[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
        """(name, local tensor, global shape, offsets) of every optimizer tensor this rank owns."""
        from pipetrain.parallel.grads import tied_copy_names
        skip = tied_copy_names(self.model)
        return adamw_state_items(self.inner, [e for e in self._entries() if e[0] not in skip], self.steps_taken)

    def load_state_items(self, read: ReadBox) -> None:
        """Load every moment this rank needs (the tied head copy from its embedding's entries)."""
        self.steps_taken = load_adamw_state(self.inner, self._entries(), read, is_tied(self.model))

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank (the AdamW moments; 0 before the first step)."""
        return adamw_state_bytes(self.inner)


def build_optimizer(model: nn.Module, dims, cfg: TrainConfig, zero: int = 0):
    """The optimizer for parallel.zero: replicated AdamW (0) or ZeRO-sharded across dp (1, 2)."""
    if zero == 0 or dims.dp == 1:
        return Optimizer(model, dims, cfg)
    from pipetrain.parallel.zero import ZeroOptimizer
    return ZeroOptimizer(model, dims, cfg, stage=zero)


def is_tied(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "cfg", None), "tied", False))


def param_boxes(model: nn.Module) -> list[tuple[str, nn.Parameter, tuple[int, ...], tuple[int, ...]]]:
    """(global name, local parameter, global shape, offsets of the local tensor) in named_parameters order."""
    layout = param_layout(model)
    out = []
    for name, p in model.named_parameters():
        shape, slices = layout[name]
        out.append((name, p, tuple(shape), tuple(s.start or 0 for s in slices)))
    return out


def adamw_state_items(inner: torch.optim.Optimizer, entries: Sequence[StateEntry],
                      step: int) -> list[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
    """The AdamW moments of entries (zeros before the first step, which creates them) and "step"."""
    items = []
    for name, p, global_shape, offsets in entries:
        state = inner.state.get(p, {})
        for moment in MOMENTS:
            tensor = state.get(moment)
            items.append((f"{moment}/{name}", torch.zeros_like(p) if tensor is None else tensor,
                          global_shape, offsets))
    items.append(("step", torch.tensor(step, dtype=torch.int64), (), ()))
    return items


def load_adamw_state(inner: torch.optim.Optimizer, entries: Sequence[StateEntry], read: ReadBox,
                     tied: bool) -> int:
    """Fill inner's state from read(); returns the step. Entries missing from a checkpoint raise in read().

    Goes through load_state_dict so torch places "step" where its AdamW variant expects it."""
    step = int(read("step", (), (), ()))
    index = {id(p): i for i, p in enumerate(p for g in inner.param_groups for p in g["params"])}
    state = {}
    for name, p, global_shape, offsets in entries:
        source = TIED_ALIASES.get(name, name) if tied else name
        moments = {m: read(f"{m}/{source}", global_shape, offsets, tuple(p.shape)).clone() for m in MOMENTS}
        for m, t in moments.items():
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"optimizer state {m}/{source}: read a box of shape {tuple(t.shape)} at "
                                 f"{offsets}, expected {tuple(p.shape)}")
        state[index[id(p)]] = {"step": torch.tensor(float(step), dtype=torch.float32), **moments}
    sd = inner.state_dict()
    sd["state"] = state
    inner.load_state_dict(sd)
    return step


def adamw_state_bytes(inner: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for st in inner.state.values() for m, t in st.items() if m in MOMENTS)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (1-based): warmup, then train.lr_schedule (lr_schedule.py)."""
    return lr_schedule.lr_at(step, cfg)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
