"""The torch optimizer (the per-rank update rule) every pipetrain optimizer drives (train.optimizer):
torch's AdamW or SGD with momentum, and its state as checkpoint boxes. pipetrain.optim.build.Optimizer,
parallel.data.zero.ZeroOptimizer and the parameter servers each hold one as `torch_opt`.

AdamW's state is pipetrain.optim.adamw's ("exp_avg/<name>", "exp_avg_sq/<name>", "step"); SGD's is
"momentum_buffer/<name>" (only with train.momentum > 0) and "step". SGD is the rule the relaxed
synchronisation equivalences are exact for (pipetrain.parallel.replicas.stale / .periodic) and DiLoCo's outer
optimizer.
"""
from __future__ import annotations

from typing import Sequence

import torch

from pipetrain.config import TrainConfig
from pipetrain.models.init import TIED_ALIASES
from pipetrain.optim.adamw import (ReadBox, StateEntry, adamw_state_bytes, adamw_state_items, build_adamw,
                                   load_adamw_state)

SGD_MOMENT = "momentum_buffer"


def build_torch_opt(groups, cfg: TrainConfig) -> torch.optim.Optimizer:
    """torch.optim.AdamW (train.optimizer=adamw) or SGD with train.momentum over groups."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, foreach=True)
    return build_adamw(groups, cfg)


def _is_sgd(torch_opt) -> bool:
    return isinstance(torch_opt, torch.optim.SGD)


def torch_opt_state_items(torch_opt, entries: Sequence[StateEntry], step: int) -> list:
    """(name, tensor, global shape, offsets) of the optimizer state of entries, plus "step"."""
    if not _is_sgd(torch_opt):
        return adamw_state_items(torch_opt, entries, step)
    items = []
    if torch_opt.defaults["momentum"]:
        for name, p, global_shape, offsets in entries:
            buf = torch_opt.state.get(p, {}).get(SGD_MOMENT)
            items.append((f"{SGD_MOMENT}/{name}", torch.zeros_like(p) if buf is None else buf, global_shape, offsets))
    items.append(("step", torch.tensor(step, dtype=torch.int64, device="cpu"), (), ()))  # saved from the CPU
    return items


def load_torch_opt_state(torch_opt, entries: Sequence[StateEntry], read: ReadBox, tied: bool) -> int:
    """Fill torch_opt's state from read(); returns the step."""
    if not _is_sgd(torch_opt):
        return load_adamw_state(torch_opt, entries, read, tied)
    step = int(read("step", (), (), ()))
    if torch_opt.defaults["momentum"] and step > 0:
        for name, p, global_shape, offsets in entries:
            source = TIED_ALIASES.get(name, name) if tied else name
            torch_opt.state[p][SGD_MOMENT] = read(f"{SGD_MOMENT}/{source}", global_shape, offsets,
                                                  tuple(p.shape)).clone().to(p.device)
    return step


def torch_opt_state_bytes(torch_opt) -> int:
    if not _is_sgd(torch_opt):
        return adamw_state_bytes(torch_opt)
    return sum(st[SGD_MOMENT].numel() * st[SGD_MOMENT].element_size()
               for st in torch_opt.state.values() if st.get(SGD_MOMENT) is not None)
