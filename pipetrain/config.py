"""Recipes: frozen dataclasses, YAML loading, --set overrides and validation.

A recipe is data only. load_recipe() reads YAML, applies `--set a.b=c` overrides, rejects unknown
keys (naming the closest valid one) and wrong types, then validates cross-field rules and raises
one ConfigError that lists every problem at once.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import yaml

from pipetrain.shipped import anchor_shipped_paths, recipe_file, shipped_names


class ConfigError(ValueError):
    """A user error in a recipe, CLI flag or layout; the CLI prints it as one line and exits 2."""


MESSAGE_VALUE_CHARS = 200  # an offending value is quoted in an error line up to this many characters


def clip(text: str, limit: int = MESSAGE_VALUE_CHARS) -> str:
    """text cut to limit characters (with the count left off), so a huge value never floods an error line."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    family: Literal["llama", "qwen2", "mistral", "gpt2"] = "llama"
    vocab_size: int = 8192
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: Optional[int] = None      # None = n_heads (no grouped-query attention)
    ffn_hidden: Optional[int] = None      # None = 4*d_model (gpt2) or SwiGLU's 8/3*d_model rounded to 64
    max_seq_len: int = 1024
    tie_embeddings: Optional[bool] = None  # None = family default (gpt2 ties, others do not)
    init_from: Optional[str] = None       # local Hugging Face model directory
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qkv_bias: Optional[bool] = None       # None = family default (qwen2 True)
    sliding_window: Optional[int] = None  # mistral: attend to at most this many previous tokens
    init_std: float = 0.02
    # LoRA (pipetrain/parallel/tensor/lora.py): None = off; else the adapter rank r, with base weights frozen
    lora_rank: Optional[int] = None
    lora_alpha: float = 16.0              # the adapter output is scaled by lora_alpha / lora_rank
    lora_dropout: float = 0.0             # dropout on the adapter input (training only)
    lora_targets: list = field(default_factory=list)  # of LORA_PROJECTIONS; [] = every one the family has

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        if self.family == "gpt2":
            return 4 * self.d_model
        return 64 * ((8 * self.d_model // 3 + 63) // 64)

    @property
    def tied(self) -> bool:
        return self.family == "gpt2" if self.tie_embeddings is None else self.tie_embeddings

    @property
    def has_qkv_bias(self) -> bool:
        return self.family == "qwen2" if self.qkv_bias is None else self.qkv_bias


# The projections LoRA can adapt, by our module leaf name (attn.wq ... mlp.down); gpt2 has no gate.
LORA_PROJECTIONS = ("wq", "wk", "wv", "wo", "gate", "up", "down")


def lora_projections(family: str) -> tuple[str, ...]:
    return tuple(n for n in LORA_PROJECTIONS if not (family == "gpt2" and n == "gate"))


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    dp: Optional[int] = None         # data-parallel replicas; None = world_size / (tp * pp)
    tp: int = 1                      # tensor-parallel ranks; divides n_heads, ffn and vocab
    pp: int = 1                      # pipeline stages; <= model.n_layers
    microbatches: int = 1            # per optimizer step and dp rank; >= pp for 1f1b
    schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "zbv", "dualpipev"] = "1f1b"
    virtual_stages: int = 1          # model chunks per pp rank (interleaved-1f1b)
    stage_layers: Optional[list] = None  # explicit layers per stage; None = balanced by cost
    zero: int = 0                    # 0 | 1 (shard optimizer state) | 2 (also gradients)
    recompute: Literal["none", "selective", "full"] = "none"
    recompute_layers: Optional[int] = None  # full recompute only for the first N layers of a stage
    sequence_parallel: bool = False
    split_backward: bool = False     # pp > 1: zero-bubble split, input grads sent first, W fills the waits
    auto: bool = False               # fill the parallel keys not given here at launch (pipetrain.plan)
    # ---- relaxed synchronisation across replicas (pipetrain.parallel.replicas.relaxed, docs/relaxed_sync.md) ----
    dp_shard: Optional[int] = None   # dp = dp_replicate x dp_shard; None = dp with zero >= 1, else 1
    dp_sync: Literal["bsp", "ssp", "dssp", "local_sgd", "diloco"] = "bsp"  # across dp_replicate
    staleness: int = 0               # ssp: s; dssp: the upper bound
    staleness_min: int = 0           # dssp: the lower bound
    sync_every: int = 1              # local_sgd / diloco: H inner steps between synchronisations
    sync_warmup_steps: int = 0       # local_sgd / diloco: bsp steps before local steps (post-local SGD)
    outer_lr: float = 0.7            # diloco: outer Nesterov SGD learning rate
    outer_momentum: float = 0.9      # diloco: outer momentum, in [0, 1)
    dynamic_batch: bool = False      # split the global batch among replicas by measured speed (parallel/replicas/dbs.py)
    dynamic_batch_every: int = 5     # steps per measurement window: the split may move at its end
    # ---- hybrid parameter server for the input embedding (pipetrain.parallel.ps.core, docs/parameter_server.md) ----
    ps_servers: int = 0              # extra ranks holding the embedding table; world = dp x tp x pp + ps_servers
    ps_sync: Literal["bsp", "ssp", "async"] = "bsp"  # ssp bounds pulled rows' age by parallel.staleness
    # ---- replica failover (pipetrain.parallel.replicas.failover, docs/fault_tolerance.md) ----
    fault_tolerance: Literal["none", "torchft"] = "none"  # torchft: each dp_replicate group is a torchft replica
    ft_connect_timeout_s: float = 60.0  # torchft: how long a group waits for the lighthouse before exit 2


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 100
    global_batch: int = 8            # sequences per optimizer step, over all dp ranks
    seq_len: int = 256
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0           # 0 disables clipping
    seed: int = 1234
    precision: Literal["fp32", "bf16"] = "fp32"
    grad_accumulation_fusion: bool = True  # add weight grads into .grad in place (pipetrain.parallel.pipeline.weight_grads)
    grad_accumulation_fusion_min_numel: int = 1 << 20  # smallest weight fused; smaller ones cost more than they save
    lr_schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"  # after warmup (pipetrain.lr_schedule)
    decay_fraction: float = 0.2      # wsd: the last fraction of train.steps decays linearly to min_lr
    optimizer: Literal["adamw", "sgd"] = "adamw"  # sgd: momentum train.momentum, weight decay train.weight_decay
    momentum: float = 0.0            # sgd only
    compile: bool = False            # torch.compile each transformer block, fullgraph (pipetrain.models.compile)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    path: str = ""                   # local text/jsonl/parquet file or folder, or a datasets name
    tokenizer: str = ""              # local tokenizer directory or name
    text_field: str = "text"
    val_fraction: float = 0.05
    seed: int = 1234
    cache_dir: Optional[str] = None  # tokenised-data cache; None = ~/.cache/pipetrain
    sources: Optional[list] = None   # blend: [{path, weight}], each path raw data or a prepared dir; None = data.path
    document_mask: bool = False      # block-causal attention per document and positions restarting at each
    num_proc: int = 1                # processes tokenising in `prepare`
    verify: bool = True              # check prepared files' sha256 against their manifest at start


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    every: int = 0                   # steps; 0 = only at the end
    keep: int = 3                    # newest K checkpoints kept
    verify: bool = True              # verify per-file checksums on load
    async_: bool = False             # YAML key `async`: snapshot to host, write in the background


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    output_dir: str = "runs/default"
    log_every: int = 1
    eval_every: int = 0              # 0 = only at the end
    eval_batches: int = 4
    peak_tflops: Optional[float] = None  # per device, for MFU; None = from the GPU table
    sample_tokens: int = 200         # tokens generated at the end of a run (0 = none)
    progress: bool = True
    trackers: list = field(default_factory=list)  # any of tensorboard, wandb (optional extras); [] = none
    # seconds from SIGTERM to a saved exit; past it the run exits 143 without saving. Default 20: below
    # the 30 s that Slurm (KillWait) and Kubernetes (terminationGracePeriodSeconds) wait before SIGKILL,
    # leaving 10 s for the save to finish and the process to exit on its own terms
    stop_timeout_s: float = 20.0


@dataclass(frozen=True, kw_only=True)
class FaultsConfig:
    """Injected stragglers (and, later, kills) for drills and tests; off by default (pipetrain.faults)."""
    slow_ranks: list = field(default_factory=list)  # global ranks whose steps may be slow
    slow_factor: float = 1.0         # a slow step takes this many times its compute
    slow_prob: float = 1.0           # per step, seeded by (seed, step, rank): 1 persistent, < 1 transient
    seed: int = 0
    kill_rank: Optional[int] = None  # this global rank SIGKILLs itself as step kill_at_step begins (first attempt)
    kill_at_step: Optional[int] = None


@dataclass(frozen=True, kw_only=True)
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for (section, key), field in _KEY_ALIASES.items():
            out[section][key] = out[section].pop(field)
        return out


_SECTION_CLASSES = {
    "model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig,
    "data": DataConfig, "checkpoint": CheckpointConfig, "run": RunConfig, "faults": FaultsConfig,
}
# Recipe keys that are Python keywords, and their dataclass fields.
_KEY_ALIASES = {("checkpoint", "async"): "async_"}
# Paths in a YAML file are relative to that file; paths from --set are relative to the cwd.
_PATH_KEYS = {("data", "path"), ("data", "tokenizer"), ("data", "cache_dir"),
              ("model", "init_from"), ("run", "output_dir")}


def _closest(name: str, options) -> str:
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else f"; valid keys: {', '.join(sorted(options))}"


def _check_type(where: str, value: Any, hint: Any, problems: list[str]) -> Any:
    """Coerce ints to floats where a float is expected; record a problem for any other mismatch."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check_type(where, value, inner[0], problems)
    if origin is Literal:
        if value not in args:
            problems.append(f"{where}={clip(repr(value))} is not one of {', '.join(map(str, args))}")
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        # PyYAML reads "2e-3" (no dot) as a string: accept any text that is a float literal.
        try:
            return float(value)
        except ValueError:
            pass
    if hint is list:
        if not isinstance(value, list):
            problems.append(f"{where}={clip(repr(value))} must be a list")
        return value
    expected = {int: int, float: float, str: str, bool: bool}.get(hint)
    if expected is not None:
        ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
        if not ok:
            problems.append(f"{where}={clip(repr(value))} must be {expected.__name__}, got {type(value).__name__}")
    return value


def _resolve_path(value: Optional[str], base: str) -> Optional[str]:
    """Make a relative path absolute against base; a hub name ("gpt2", "user/corpus") with no such
    local path stays as written."""
    if not value:
        return value
    expanded = os.path.expanduser(value)
    if os.path.isabs(expanded):
        return expanded
    candidate = os.path.normpath(os.path.join(base, expanded))
    looks_local = expanded.startswith(".") or os.path.exists(candidate)
    return candidate if looks_local or expanded.count("/") > 1 else value


def _resolve_paths(section: str, key: str, value: Any, base: str) -> Any:
    """A path key's value, or data.sources' path entries, resolved against base (the recipe file's folder,
    or the current directory for --set)."""
    if (section, key) in _PATH_KEYS and isinstance(value, str):
        return _resolve_path(value, base)
    if (section, key) == ("data", "sources") and isinstance(value, list):  # each source path as data.path
        return [{**s, "path": _resolve_path(s["path"], base)} if isinstance(s, dict) and isinstance(s.get("path"), str)
                else s for s in value]
    return value


# What a recipe may expand to: a YAML alias names a node again, so a small file can describe a
# structure of billions of nodes ("billion laughs"); these bound it before any Python object is built.
MAX_RECIPE_BYTES = 1 << 20      # 1 MiB of YAML text
MAX_RECIPE_NODES = 100_000      # scalars, lists and mappings after aliases are expanded
MAX_RECIPE_DEPTH = 32           # nesting of lists and mappings


def bounded_yaml(text: str, where: str) -> Any:
    """yaml.safe_load of text, refused (ConfigError) past MAX_RECIPE_BYTES / NODES / DEPTH."""
    if len(text) > MAX_RECIPE_BYTES:
        raise ConfigError(f"{where}: {len(text)} characters of YAML, over the {MAX_RECIPE_BYTES} limit; "
                          "a recipe is a short file of settings")
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        count, stack = 0, [(node, 1)]
        while stack:  # walks aliases as often as they are used: what construction would expand
            item, depth = stack.pop()
            count += 1
            if count > MAX_RECIPE_NODES or depth > MAX_RECIPE_DEPTH:
                raise ConfigError(f"{where}: the YAML expands past {MAX_RECIPE_NODES} nodes or "
                                  f"{MAX_RECIPE_DEPTH} levels (aliases count each time they are used); "
                                  "write the values out plainly")
            if isinstance(item, yaml.SequenceNode):
                stack.extend((child, depth + 1) for child in item.value)
            elif isinstance(item, yaml.MappingNode):
                stack.extend((child, depth + 1) for pair in item.value for child in pair)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def parse_override(text: str) -> tuple[str, str, Any]:
    """'parallel.tp=2' -> ('parallel', 'tp', 2); the value is parsed as a YAML scalar."""
    if "=" not in text:
        raise ConfigError(f"--set {clip(repr(text))}: expected KEY=VALUE such as parallel.tp=2")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2:
        raise ConfigError(f"--set {clip(repr(text))}: key must be SECTION.NAME such as train.steps")
    try:
        value = bounded_yaml(raw, f"--set {clip(key)}") if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {clip(repr(text))}: value is not a YAML scalar ({exc.problem})") from None
    return parts[0], parts[1], value


def build_recipe(raw: dict, overrides: list[str] = (), base_dir: str | None = None) -> Recipe:
    """Build and validate a Recipe from a nested dict plus overrides; raise one ConfigError for all problems."""
    problems: list[str] = []
    base_dir = base_dir or os.getcwd()
    if not isinstance(raw, dict):
        raise ConfigError("recipe: top level must be a mapping of sections (model, parallel, train, ...)")
    values: dict[str, dict] = {name: {} for name in _SECTION_CLASSES}
    for section, body in raw.items():
        if section not in _SECTION_CLASSES:
            problems.append(f"unknown section '{section}'{_closest(section, _SECTION_CLASSES)}")
            continue
        if body is None:
            continue
        if not isinstance(body, dict):
            problems.append(f"section '{section}' must be a mapping of keys")
            continue
        for key, value in body.items():
            values[section][key] = _resolve_paths(section, key, value, base_dir)
    for text in overrides:
        section, key, value = parse_override(text)
        if section not in _SECTION_CLASSES:
            problems.append(f"--set {text}: unknown section '{section}'{_closest(section, _SECTION_CLASSES)}")
            continue
        values[section][key] = _resolve_paths(section, key, value, os.getcwd())

    sections = {}
    for section, cls in _SECTION_CLASSES.items():
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for key, value in values[section].items():
            field = _KEY_ALIASES.get((section, key), key)
            if field not in hints:
                problems.append(f"unknown key '{section}.{key}'{_closest(key, hints)}")
                continue
            kwargs[field] = _check_type(f"{section}.{key}", value, hints[field], problems)
        if problems:
            continue
        sections[section] = cls(**kwargs)
    if problems:
        raise ConfigError("; ".join(problems))
    recipe = Recipe(**sections)
    problems = validate(recipe)
    if problems:
        raise ConfigError("; ".join(problems))
    return recipe


def load_recipe(path: str, overrides: list[str] = ()) -> Recipe:
    """Read a YAML recipe file (or the shipped recipe of that name, pipetrain.shipped), apply overrides, validate."""
    file = recipe_file(path)
    if file is None:
        raise ConfigError(f"--recipe: not found as a file or a shipped recipe name, got {path!r}; pass a recipe "
                          f"file's path or a shipped name ({', '.join(shipped_names())})")
    with open(file) as f:
        try:
            raw = bounded_yaml(f.read(MAX_RECIPE_BYTES + 1), f"recipe {path}") or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise ConfigError(f"recipe {path}: invalid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if file != path:  # found by name: shipped data stays in the package, output goes under the current directory
        return build_recipe(anchor_shipped_paths(raw, _PATH_KEYS), overrides, base_dir=os.getcwd())
    return build_recipe(raw, overrides, base_dir=os.path.dirname(os.path.abspath(path)))


def validate(r: Recipe) -> list[str]:
    """Cross-field rules that need no world size; returns every problem found (empty when consistent).
    The layout rules (degrees against the world size, the model and the schedule) are
    pipetrain.parallel.mesh.layout.layout_problems."""
    m, p, t, d = r.model, r.parallel, r.train, r.data
    problems = []

    def need(cond: bool, msg: str):
        if not cond:
            problems.append(msg)

    for sec, name in [(m, "vocab_size"), (m, "d_model"), (m, "n_layers"), (m, "n_heads"), (m, "max_seq_len"),
                      (p, "tp"), (p, "pp"), (p, "microbatches"), (p, "virtual_stages"),
                      (t, "global_batch"), (t, "seq_len")]:
        need(getattr(sec, name) >= 1, f"{_sec(sec)}.{name}={getattr(sec, name)} must be >= 1")
    if problems:
        return problems
    if not m.init_from:  # with init_from the HF config defines these; checked again once it is read
        need(m.d_model % m.n_heads == 0, f"model.d_model={m.d_model} must be divisible by model.n_heads={m.n_heads}")
        need(m.n_heads % m.kv_heads == 0,
             f"model.n_heads={m.n_heads} must be divisible by model.n_kv_heads={m.kv_heads}")
        need(m.family == "gpt2" or m.head_dim % 2 == 0,
             f"model head dim d_model/n_heads={m.head_dim} must be even for RoPE")
        need(t.seq_len <= m.max_seq_len, f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    need(t.steps >= 0, f"train.steps={t.steps} must be >= 0")
    need(t.lr >= 0, f"train.lr={t.lr} must be >= 0 (0 keeps the weights frozen)")
    need(0 <= t.min_lr <= t.lr, f"train.min_lr={t.min_lr} must be between 0 and train.lr={t.lr}")
    need(t.warmup_steps >= 0, f"train.warmup_steps={t.warmup_steps} must be >= 0")
    need(t.grad_clip >= 0, f"train.grad_clip={t.grad_clip} must be >= 0 (0 disables clipping)")
    need(t.grad_accumulation_fusion_min_numel >= 0, f"train.grad_accumulation_fusion_min_numel="
         f"{t.grad_accumulation_fusion_min_numel} must be >= 0 (0 fuses every weight)")
    need(0 <= d.val_fraction < 1, f"data.val_fraction={d.val_fraction} must be in [0, 1)")
    need(bool(d.path) or bool(d.sources),
         "data.path is empty; set it to a text/jsonl/parquet file or folder, a prepared directory, or data.sources")
    need(not (d.path and d.sources), "data.path and data.sources are both set; list every path under data.sources")
    for i, src in enumerate(d.sources or []):
        ok = isinstance(src, dict) and set(src) <= {"path", "weight"} and isinstance(src.get("path"), str)
        need(ok and bool(src["path"]), f"data.sources[{i}]={clip(repr(src))} must be a mapping {{path: ..., weight: ...}}")
        w = src.get("weight", 1.0) if ok else 1.0
        need(isinstance(w, (int, float)) and not isinstance(w, bool) and 0 < w < float("inf"),
             f"data.sources[{i}].weight={clip(repr(w))} must be a positive finite number; give every source a "
             "weight > 0")
    need(d.num_proc >= 1, f"data.num_proc={d.num_proc} must be >= 1")
    need(bool(d.tokenizer) or bool(m.init_from),
         "data.tokenizer is empty; set it to a tokenizer directory (or set model.init_from)")
    need(0 < r.parallel.ft_connect_timeout_s < float("inf"), f"parallel.ft_connect_timeout_s="
         f"{r.parallel.ft_connect_timeout_s} must be a positive number of seconds (torchft's default is 60)")
    need(r.checkpoint.every >= 0, f"checkpoint.every={r.checkpoint.every} must be >= 0")
    need(r.checkpoint.keep >= 1, f"checkpoint.keep={r.checkpoint.keep} must be >= 1")
    need(r.run.log_every >= 1, f"run.log_every={r.run.log_every} must be >= 1")
    need(r.run.eval_every >= 0, f"run.eval_every={r.run.eval_every} must be >= 0")
    need(0 <= t.decay_fraction <= 1, f"train.decay_fraction={t.decay_fraction} must be in [0, 1]; it is the "
         "share of train.steps that train.lr_schedule=wsd spends decaying to train.min_lr")
    for name in r.run.trackers:
        need(name in ("tensorboard", "wandb"), f"run.trackers: unknown tracker, got {clip(repr(name))}; "
             "use a list of tensorboard and/or wandb, e.g. [tensorboard]")
    if m.lora_rank is None:
        need(not m.lora_targets, f"model.lora_targets={m.lora_targets} is set but model.lora_rank is not; "
             "set model.lora_rank (e.g. 8) to train LoRA adapters, or remove model.lora_targets")
    else:
        need(m.lora_rank >= 1, f"model.lora_rank={m.lora_rank} must be >= 1; use e.g. 8, or remove it "
             "for full fine-tuning")
        need(m.lora_alpha > 0, f"model.lora_alpha={m.lora_alpha} must be > 0 (the scale is alpha / rank)")
        need(0 <= m.lora_dropout < 1, f"model.lora_dropout={m.lora_dropout} must be in [0, 1)")
        known = lora_projections(m.family)
        for name in m.lora_targets:
            need(name in known, f"model.lora_targets: {m.family} has no projection {clip(repr(name))}, got "
                 f"{m.lora_targets}; use names from {list(known)}")
    need(p.zero in (0, 1, 2), f"parallel.zero={p.zero} is not offered; use 0, 1 or 2 (ZeRO-3 is not implemented)")
    if p.dp is not None:
        need(p.dp >= 1, f"parallel.dp={p.dp} must be >= 1")
    problems += _relaxed_problems(r)
    problems += _fault_tolerance_problems(r.parallel)
    return problems


def _relaxed_problems(r: Recipe) -> list[str]:
    """Relaxed synchronisation, the optimizer and fault-injection keys that need no world size
    (the layout ones, dp_replicate > 1 and slow ranks inside the world, are layout_problems')."""
    p, t, f = r.parallel, r.train, r.faults
    out = []

    def need(cond: bool, msg: str):
        if not cond:
            out.append(msg)

    if p.dp_shard is not None:
        need(p.dp_shard >= 1, f"parallel.dp_shard: must be >= 1, got {p.dp_shard}; drop it for the default")
    need(p.staleness >= 0, f"parallel.staleness: must be >= 0, got {p.staleness}; use 0 (bsp) or more")
    need(p.staleness_min >= 0, f"parallel.staleness_min: must be >= 0, got {p.staleness_min}; use 0 or more")
    if p.dp_sync == "dssp":
        need(p.staleness_min <= p.staleness, f"parallel.staleness_min: must be <= parallel.staleness="
             f"{p.staleness}, got {p.staleness_min}; lower staleness_min or raise staleness")
    need(p.sync_every >= 1, f"parallel.sync_every: must be >= 1, got {p.sync_every}; use 1 or more steps")
    need(p.dynamic_batch_every >= 1, f"parallel.dynamic_batch_every: must be >= 1, got {p.dynamic_batch_every}; "
         "use 5 (a median over 5 steps ignores one slow step)")
    need(p.sync_warmup_steps >= 0, f"parallel.sync_warmup_steps: must be >= 0, got {p.sync_warmup_steps}")
    need(p.outer_lr > 0, f"parallel.outer_lr: must be > 0, got {p.outer_lr}; DiLoCo uses about 0.7")
    need(0 <= p.outer_momentum < 1, f"parallel.outer_momentum: must be in [0, 1), got {p.outer_momentum}; "
         "DiLoCo uses 0.9")
    need(0 <= t.momentum < 1, f"train.momentum: must be in [0, 1), got {t.momentum}; use 0 or 0.9")
    need(t.optimizer == "sgd" or t.momentum == 0, f"train.momentum: applies to train.optimizer=sgd only, got "
         f"{t.momentum} with {t.optimizer}; set train.optimizer=sgd or drop train.momentum")
    need(all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in f.slow_ranks),
         f"faults.slow_ranks: must list global ranks (integers >= 0), got {f.slow_ranks}")
    need(f.slow_factor >= 1, f"faults.slow_factor: must be >= 1 (a slow step takes f times its compute), "
         f"got {f.slow_factor}")
    need(0 <= f.slow_prob <= 1, f"faults.slow_prob: must be in [0, 1], got {f.slow_prob}; 1 is persistent")
    if f.kill_rank is not None:
        need(f.kill_rank >= 0, f"faults.kill_rank: must be >= 0, got {f.kill_rank}")
    if f.kill_at_step is not None:
        need(f.kill_at_step >= 1, f"faults.kill_at_step: must be >= 1, got {f.kill_at_step}")
    need((f.kill_rank is None) == (f.kill_at_step is None), "faults.kill_rank and faults.kill_at_step go "
         f"together (got kill_rank={f.kill_rank}, kill_at_step={f.kill_at_step}); set both or neither")
    return out + _ps_problems(r)


def _ps_problems(r: Recipe) -> list[str]:
    """parallel.ps_servers / ps_sync (pipetrain.parallel.ps.core): what a parameter server cannot serve."""
    p, m = r.parallel, r.model
    if not (isinstance(p.ps_servers, int) and not isinstance(p.ps_servers, bool) and p.ps_servers >= 0):
        return [f"parallel.ps_servers: must be an integer >= 0, got {p.ps_servers!r}; 0 turns servers off"]
    if p.ps_servers == 0:
        return [] if p.ps_sync == "bsp" else [f"parallel.ps_sync={p.ps_sync} needs parameter servers; set "
                                               "parallel.ps_servers >= 1 or drop parallel.ps_sync"]
    out = []
    if m.tied:
        out.append(f"parallel.ps_servers: needs an untied input embedding, but model.family={m.family} ties it to "
                   "the LM head (which reads every row every step); set model.tie_embeddings=false or drop "
                   "parallel.ps_servers")
    if p.ps_sync == "ssp" and p.staleness < 1:
        out.append("parallel.ps_sync=ssp needs parallel.staleness >= 1 (the versions a pulled row may lag); set "
                   "parallel.staleness, or use ps_sync=bsp (staleness 0)")
    others = [(p.dp_sync != "bsp", f"parallel.dp_sync={p.dp_sync}"), (p.dynamic_batch, "parallel.dynamic_batch"),
              (m.lora_rank is not None, "model.lora_rank"), (bool(m.init_from), "model.init_from")]
    # fault_tolerance=torchft with servers: _fault_tolerance_problems says why
    for on, key in others:
        if on:
            out.append(f"parallel.ps_servers does not combine with {key}; drop one of them (servers keep the "
                       "dense part bulk-synchronous and train the table from the seed or a checkpoint)")
    return out


def _fault_tolerance_problems(p: ParallelConfig) -> list[str]:
    """parallel.fault_tolerance=torchft: the combinations that cannot work with torchft's per-step averaging
    over the live replica groups (the launch environment is checked by pipetrain.parallel.replicas.failover)."""
    if p.fault_tolerance != "torchft":
        return []
    why = "parallel.fault_tolerance=torchft"
    out = []
    if p.dp is None:
        out.append(f"parallel.dp: must be given under {why} (replica groups x dp ranks per group), got none; "
                   "e.g. parallel.dp=2 for two replica groups of one dp rank each")
    if p.dp_sync != "bsp":
        out.append(f"parallel.dp_sync={p.dp_sync}: does not combine with {why} (torchft averages every step's "
                   "gradients over the live replica groups); use parallel.dp_sync=bsp or fault_tolerance=none")
    if p.ps_servers:
        out.append(f"parallel.ps_servers={p.ps_servers}: does not combine with {why} (the servers would be a "
                   "single point of failure outside every replica group); set parallel.ps_servers=0")
    if p.dynamic_batch:
        out.append(f"parallel.dynamic_batch: does not combine with {why} (each replica group reads a fixed "
                   "slice of the global batch); set parallel.dynamic_batch=false")
    if p.zero:
        out.append(f"parallel.zero={p.zero}: is not implemented under {why} (replica groups exchange whole "
                   "gradients); set parallel.zero=0")
    return out


def _sec(obj) -> str:
    return {v: k for k, v in _SECTION_CLASSES.items()}[type(obj)]


def dump_recipe(r: Recipe, path: str) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(r.to_dict(), f, sort_keys=False)
