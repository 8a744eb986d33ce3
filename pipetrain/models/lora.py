"""LoRA's adapter math, blind to layout: low-rank adapters on a model's projections, base weights frozen.

For each targeted projection (LORA_PLAN and model.lora_targets) two parameters are added to the
projection module itself:

    lora_A (r, D_in)  drawn like PEFT's default (uniform, bound 1/sqrt(D_in))
    lora_B (D_out, r) zeros, so the adapted model starts as the base model
    y = base(x) + (alpha / r) * dropout(x) A^T B^T

so the global names are layers.N.attn.wq.lora_A / .lora_B and every base name is unchanged (Hugging
Face load, checkpoints and export keep working). The module's class is swapped in place for a
subclass whose forward adds the adapter (as weight_grads.apply_grad_accumulation_fusion does), so the
pipeline chunks' references, the tensor-parallel hooks and the deferred weight gradients stay.

add_adapters walks the model and asks a `layout` callback, per projection, how the adapter is laid
out on this rank (which of A and B is a shard of the full tensor, whose gradient is partial, which
rows of B it uses): the plain model needs none (`replicated`); tensor parallelism's answers live in
pipetrain/parallel/tensor/lora.py, which is what build.py calls. Initialisation is layout-independent:
the full tensor is drawn from (seed, global name), then sliced (pipetrain.models.init).

Dropout draws from torch's RNG on each rank, so a run with lora_dropout > 0 is reproducible per layout,
not across layouts (the layout rule is checked with lora_dropout 0).
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipetrain.config import ConfigError, ModelConfig, lora_projections
from pipetrain.models.init import name_seed

# target name (model.lora_targets) -> module name with any "layers.<i>." prefix removed
LORA_PLAN: dict[str, str] = {"wq": "attn.wq", "wk": "attn.wk", "wv": "attn.wv", "wo": "attn.wo",
                             "gate": "mlp.gate", "up": "mlp.up", "down": "mlp.down"}
ADAPTER_NAMES = ("lora_A", "lora_B")
_LAYER_PREFIX = re.compile(r"^layers\.\d+\.")


def lora_targets(cfg: ModelConfig) -> tuple[str, ...]:
    """The targets of cfg (model.lora_targets, or every projection the family has when empty)."""
    return tuple(cfg.lora_targets) or lora_projections(cfg.family, cfg.is_moe)


def is_adapter(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ADAPTER_NAMES


class LoRAAdapted:
    """Mixin of an adapted projection: forward adds (alpha / r) B A dropout(x) to the base output."""

    lora_scale: float
    lora_dropout: float
    lora_rows: tuple[int, int] | None = None  # replicated kv: the rows of B this rank's kv head uses

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_dropout and self.training:
            x = F.dropout(x, self.lora_dropout)
        b = self.lora_B if self.lora_rows is None else self.lora_B[self.lora_rows[0]:self.lora_rows[1]]
        return F.linear(F.linear(x, self.lora_A), b) * self.lora_scale  # (B, T, r) inside

    def forward(self, x):
        return super().forward(x) + self.lora_delta(x)


@dataclasses.dataclass
class AdapterLayout:
    """How one projection's adapter sits on this rank.

    shards: adapter name -> (dim, index, count) when this rank holds a slice of the full tensor
    partial: adapter names whose gradient is a partial sum over the tp group
    rows: the rows of B this rank uses (a replicated kv head), or None
    mixin: the forward to add (LoRAAdapted, or a layout's variant)"""
    shards: dict = dataclasses.field(default_factory=dict)
    partial: tuple = ()
    rows: tuple[int, int] | None = None
    mixin: type = LoRAAdapted


def replicated(module: nn.Module) -> AdapterLayout:
    """The plain model's layout: both adapters whole, nothing partial."""
    return AdapterLayout()


_CLASSES: dict[tuple[type, type], type] = {}


def _adapted_class(cls: type, mixin: type) -> type:
    if (cls, mixin) not in _CLASSES:
        _CLASSES[cls, mixin] = type(f"LoRA{cls.__name__}", (mixin, cls), {"lora_base_class": cls})
    return _CLASSES[cls, mixin]


def adapter_init(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The full fp32 adapter tensor of a global name: lora_A uniform(+-1/sqrt(D_in)), lora_B zeros."""
    if name.endswith("lora_B"):
        return torch.zeros(shape)
    bound = 1.0 / math.sqrt(shape[1])
    gen = torch.Generator().manual_seed(name_seed(seed, name))
    return torch.empty(shape).uniform_(-bound, bound, generator=gen)


@torch.no_grad()
def add_adapters(model: nn.Module, cfg: ModelConfig, seed: int, partial_grads: bool = False,
                 layout: Callable[[nn.Module], AdapterLayout] = replicated) -> list[str]:
    """Freeze model and add adapters to its targeted projections (module docstring), in place, with
    weights of the base's device and dtype, laid out as `layout` says; `partial_grads` records the
    layout's partial gradients on the module (tp > 1). Returns the adapted module names. A no-op
    when cfg.lora_rank is None."""
    if cfg.lora_rank is None:
        return []
    if any(isinstance(m, LoRAAdapted) for m in model.modules()):
        raise ValueError("apply_lora: the model already has adapters; apply it once")
    known = lora_projections(cfg.family, cfg.is_moe)
    bad = [t for t in lora_targets(cfg) if t not in known]
    if bad:
        raise ConfigError(f"model.lora_targets: {cfg.family} has no projection {bad[0]!r}, got "
                          f"{list(cfg.lora_targets)}; use names from {list(known)}")
    wanted = {LORA_PLAN[t] for t in lora_targets(cfg)}
    for p in model.parameters():
        p.requires_grad_(False)
    r = cfg.lora_rank
    adapted = []
    for name, module in list(model.named_modules()):
        if _LAYER_PREFIX.sub("", name) not in wanted:
            continue
        w = module.weight
        plan = layout(module)
        shards = dict(getattr(module, "param_shards", {})) | plan.shards
        partial = tuple(getattr(module, "tp_partial_grads", ())) + plan.partial
        full_shapes = {"lora_A": (r, module.in_features), "lora_B": (module.out_features, r)}
        for pname, full_shape in full_shapes.items():
            full = adapter_init(f"{name}.{pname}", full_shape, seed)
            if pname in plan.shards:
                dim, index, count = plan.shards[pname]
                full = full.chunk(count, dim)[index]
            setattr(module, pname, nn.Parameter(full.to(device=w.device, dtype=w.dtype).contiguous()))
        if shards:
            module.param_shards = shards
        if partial and partial_grads:
            module.tp_partial_grads = partial
        if plan.rows is not None:
            module.lora_rows = plan.rows
        module.lora_scale = cfg.lora_alpha / r
        module.lora_dropout = cfg.lora_dropout
        module.__class__ = _adapted_class(type(module), plan.mixin)
        adapted.append(name)
    return adapted


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (W += (alpha / r) B A) and restore the plain classes,
    in place; for a whole single-process model (the merged export). Returns model."""
    for module in model.modules():
        if not isinstance(module, LoRAAdapted):
            continue
        module.weight.add_((module.lora_B.float() @ module.lora_A.float() * module.lora_scale).to(module.weight.dtype))
        del module.lora_A, module.lora_B
        module.__class__ = module.lora_base_class
        shards = getattr(module, "param_shards", None)
        if shards:
            shards.pop("lora_A", None)
            shards.pop("lora_B", None)
    return model


def count_trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
