"""The AdamW pieces both optimizers share (pipetrain.optim.build.Optimizer and parallel.data.zero.ZeroOptimizer):
weight-decay groups, torch's AdamW, and its state as boxes of global tensors for checkpoints.

Checkpoints see every optimizer alike through state_items() / load_state_items(read): each AdamW
moment is listed under "exp_avg/<global name>" and "exp_avg_sq/<global name>" as a box (offsets
along each dim) of the global tensor, plus the scalar "step". For parallel.zero = 0 a box is the
rank's whole tp shard; pipetrain.parallel.data.zero lists its dp row shards the same way. The fp32
parameters are the master weights (also under train.precision=bf16, which autocasts only compute),
so no separate master copy is listed.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn as nn

from pipetrain.config import TrainConfig
from pipetrain.models.init import TIED_ALIASES, param_layout

MOMENTS = ("exp_avg", "exp_avg_sq")
# read(name, global_shape, offsets, shape) -> the box of the global tensor this rank needs
ReadBox = Callable[[str, tuple, tuple, tuple], torch.Tensor]
# (global name, tensor the optimizer steps, global shape, offsets of that tensor in the global one)
StateEntry = tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]

_NO_DECAY_MODULES = ("embed", "pos_embed")
# devices whose parameters get torch's fused AdamW (one kernel per step, clip and skip on the device:
# pipetrain.optim.build.Optimizer.clip_and_step); elsewhere foreach. The CPU has a fused AdamW too, but
# the CPU suite's figures and memory model are foreach's; tests add "cpu" to run the fused path here.
FUSED_DEVICES = ("cuda",)


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
    # foreach keeps the per-parameter loop out of Python; fused also keeps the update in one kernel
    fused = all(p.device.type in FUSED_DEVICES for g in params_or_groups
                for p in (g["params"] if isinstance(g, dict) else [g]))
    return torch.optim.AdamW(params_or_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                             fused=fused or None, foreach=None if fused else True)


def step_adamw(opt: torch.optim.Optimizer) -> None:
    """opt.step() with the CPU as the default device. torch's AdamW (2.11 at least) makes each parameter's
    "step" counter on the default device at the first step, and its foreach and single-tensor paths need
    that counter on the CPU; a program that sets another default device (torch.set_default_device) would
    have it there and fail. Under the usual CPU default this is opt.step() itself."""
    if torch.get_default_device().type == "cpu":
        opt.step()
        return
    with torch.device("cpu"):
        opt.step()


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


def adamw_state_items(adamw: torch.optim.Optimizer, entries: Sequence[StateEntry],
                      step: int) -> list[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
    """The AdamW moments of entries (zeros before the first step, which creates them) and "step"."""
    items = []
    for name, p, global_shape, offsets in entries:
        state = adamw.state.get(p, {})
        for moment in MOMENTS:
            tensor = state.get(moment)
            items.append((f"{moment}/{name}", torch.zeros_like(p) if tensor is None else tensor,
                          global_shape, offsets))
    items.append(("step", torch.tensor(step, dtype=torch.int64, device="cpu"), (), ()))  # saved from the CPU
    return items


def load_adamw_state(adamw: torch.optim.Optimizer, entries: Sequence[StateEntry], read: ReadBox,
                     tied: bool) -> int:
    """Fill adamw's state from read(); returns the step. Entries missing from a checkpoint raise in read().

    Goes through load_state_dict so torch places "step" where its AdamW variant expects it."""
    step = int(read("step", (), (), ()))
    index = {id(p): i for i, p in enumerate(p for g in adamw.param_groups for p in g["params"])}
    state = {}
    for name, p, global_shape, offsets in entries:
        source = TIED_ALIASES.get(name, name) if tied else name
        moments = {m: read(f"{m}/{source}", global_shape, offsets, tuple(p.shape)).clone() for m in MOMENTS}
        for m, t in moments.items():
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"optimizer state {m}/{source}: read a box of shape {tuple(t.shape)} at "
                                 f"{offsets}, expected {tuple(p.shape)}")
        state[index[id(p)]] = {"step": torch.tensor(float(step), dtype=torch.float32, device="cpu"), **moments}
    sd = adamw.state_dict()
    sd["state"] = state
    adamw.load_state_dict(sd)
    return step


def adamw_state_bytes(adamw: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for st in adamw.state.values() for m, t in st.items() if m in MOMENTS)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
