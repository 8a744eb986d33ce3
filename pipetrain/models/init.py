"""Layout-independent initialisation.

Every parameter is drawn in full from a generator seeded by (seed, global name) and then sliced to
the local shard, so any tensor/pipeline layout starts from exactly the single-process weights.
Modules that hold a shard say so in `param_shards = {"weight": (dim, index, count)}`: the local
tensor is chunk `index` of `count` equal chunks of the global tensor along `dim`. A tensor split along
two dims (experts: dim 0 over ep, F over tp) lists one such triple per dim: ((0, i, n), (1, j, m)).
"""
from __future__ import annotations

import hashlib
import math

import torch
import torch.nn as nn

from pipetrain.config import ModelConfig

# When the embedding is tied, a pipeline's last stage holds its own copy of it under this name.
TIED_ALIASES = {"head.weight": "embed.weight"}


def name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def param_layout(model: nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[slice, ...]]]:
    """{global name: (global shape, local slices)} for every parameter the module holds."""
    out, seen = {}, set()
    for mod_name, module in model.named_modules():
        shards = getattr(module, "param_shards", {})
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in seen:  # a tied parameter is listed once, under its first name
                continue
            seen.add(id(p))
            shape = list(p.shape)
            slices = [slice(None)] * p.dim()
            specs = shards.get(p_name, ())
            for dim, index, count in ((specs,) if specs and isinstance(specs[0], int) else specs):
                shape[dim] = p.shape[dim] * count
                slices[dim] = slice(index * p.shape[dim], (index + 1) * p.shape[dim])
            full_name = f"{mod_name}.{p_name}" if mod_name else p_name
            out[full_name] = (tuple(shape), tuple(slices))
    return out


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """{global name: buffer} of the model's state_dict buffers: training state that is not a parameter,
    replicated over dp and tp (a MoE router's expert_bias); checkpoints hold them under buffer/."""
    out = {}
    for mod_name, module in model.named_modules():
        for b_name, b in module.named_buffers(recurse=False):
            if b_name not in module._non_persistent_buffers_set:
                out[f"{mod_name}.{b_name}" if mod_name else b_name] = b
    return out


# init_rows draws this many elements at a time: a multiple of 16, the block torch's CPU normal_ transforms
# at once, so chunk by chunk the stream gives the full draw's values (tests/unit/test_ps.py checks it)
INIT_CHUNK = 1 << 20


def _init_rule(cfg: ModelConfig, name: str) -> tuple[str, float]:
    """("zeros" | "ones" | "normal", std) of a global parameter name."""
    leaf = name.rsplit(".", 1)[-1]
    owner = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
    if leaf == "bias":
        return "zeros", 0.0
    if "norm" in owner:
        return "ones", 0.0
    std = cfg.init_std
    if owner in ("wo", "down") or name.endswith("experts.down"):
        std = std / math.sqrt(2 * cfg.n_layers)  # GPT-2 scaling of residual-branch outputs
    return "normal", std


def init_tensor(cfg: ModelConfig, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The full fp32 tensor for a global parameter name (a deterministic function of seed and name)."""
    name = TIED_ALIASES.get(name, name) if cfg.tied else name
    kind, std = _init_rule(cfg, name)
    if kind != "normal":
        return (torch.zeros if kind == "zeros" else torch.ones)(shape, device="cpu")
    gen = torch.Generator().manual_seed(name_seed(seed, name))
    return torch.empty(shape, device="cpu").normal_(0.0, std, generator=gen)  # the generator's device


def init_rows(cfg: ModelConfig, name: str, shape: tuple[int, ...], seed: int, lo: int, hi: int,
              chunk: int = INIT_CHUNK) -> torch.Tensor:
    """Rows [lo, hi) of init_tensor(cfg, name, shape, seed), bitwise, holding only them and one chunk (a
    parameter server's shard of the table). The generator's stream is drawn from its start in chunks of
    the flat tensor and the chunks before lo are dropped: a CPU generator cannot skip ahead. normal_ on 16
    or more elements transforms blocks of 16 and redraws the last 16 when the size is not a multiple of
    16, so every chunk but the last is a multiple of 16, a tail under 16 joins the chunk before it, and
    rows whose values that redraw may overwrite (the last 16 elements) are drawn through to the end."""
    assert 0 <= lo <= hi <= shape[0] and chunk % 16 == 0, f"init_rows: rows [{lo}, {hi}) of {shape}, chunk {chunk}"
    name = TIED_ALIASES.get(name, name) if cfg.tied else name
    kind, std = _init_rule(cfg, name)
    rest = tuple(shape[1:])
    if kind != "normal":
        return (torch.zeros if kind == "zeros" else torch.ones)((hi - lo, *rest), device="cpu")
    row = math.prod(rest)
    total, start, stop = shape[0] * row, lo * row, hi * row
    out = torch.empty(stop - start, device="cpu")
    gen = torch.Generator().manual_seed(name_seed(seed, name))
    end = total if stop > total - 16 else stop
    pos = 0
    while pos < end:
        size = min(chunk, total - pos)
        if 0 < total - pos - size < 16:
            size = total - pos
        block = torch.empty(size, device="cpu").normal_(0.0, std, generator=gen)
        a, b = max(pos, start), min(pos + size, stop)
        if a < b:
            out[a - start:b - start] = block[a - pos:b - pos]
        pos += size
    return out.view(hi - lo, *rest)


@torch.no_grad()
def materialize(model: nn.Module, cfg: ModelConfig, seed: int, device: torch.device | str) -> nn.Module:
    """Allocate a meta-built model on device and initialise every (possibly sharded) parameter."""
    # to_empty() gives every module its own new tensor, which would silently untie shared
    # parameters (the tied embedding): remember who shares what and tie them again afterwards.
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for p_name, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((module, p_name))
    model.to_empty(device=device)
    for places in owners.values():
        first_module, first_name = places[0]
        for module, p_name in places[1:]:
            setattr(module, p_name, getattr(first_module, first_name))
    for module in model.modules():  # buffers: the MoE router's aux-free bias starts at zero
        for buf in module.buffers(recurse=False):
            buf.zero_()
    params = dict(model.named_parameters())
    for name, (shape, slices) in param_layout(model).items():
        full = init_tensor(cfg, name, shape, seed)
        params[name].copy_(full[slices])
    return model
