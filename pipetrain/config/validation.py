"""Validation without a world size: the cross-field rules of the keys config owns (model, train, data,
checkpoint, run, faults).

The rules on parallel keys live with the mesh (pipetrain.parallel.mesh.rules: one place for every layout
rule, written once). config sits below parallel and may not import it, so validate takes those rules as a
callable and reports their problems with its own, in one list: load_recipe's callers still get every
problem at once.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

from pipetrain.config.schema import SECTIONS, ModelConfig, Recipe, clip, lora_projections

SEED_LIMIT = 2 ** 63  # torch.manual_seed and numpy take seeds in [0, 2**63)
FLOAT32_MAX = 3.4028234663852886e38  # the largest float32: a float key past it overflows the tensor it scales
MAX_STOP_TIMEOUT_S = 86400  # run.stop_timeout_s: a day (the stop guard's socket refuses a timeout past ~9e9 s)
MAX_SLOW_FACTOR = 1000  # faults.slow_factor: a slow step sleeps (f - 1) x its compute; past this a run only hangs

Rules = Callable[[Recipe], list[str]]  # more rules on a recipe: every problem found (empty when consistent)


def validate(r: Recipe, rules: Rules | None = None) -> list[str]:
    """Every problem with r's keys that needs no world size, followed by rules(r)'s (empty when consistent).
    rules: pipetrain.parallel.mesh.rules.parallel_problems wherever the recipe is to run (the CLI, build);
    the layout rules that need the world size are that module's layout_problems."""
    return _own_problems(r) + (rules(r) if rules is not None else [])


def _own_problems(r: Recipe) -> list[str]:
    m, t, d, f = r.model, r.train, r.data, r.faults
    problems = []

    def need(cond: bool, msg: str):
        if not cond:
            problems.append(msg)

    non_finite = _non_finite(r)
    problems += non_finite
    for sec, name in [(m, "vocab_size"), (m, "d_model"), (m, "n_layers"), (m, "n_heads"), (m, "max_seq_len"),
                      (t, "global_batch"), (t, "seq_len")]:
        need(getattr(sec, name) >= 1, f"{_sec(sec)}.{name}={getattr(sec, name)} must be >= 1")
    for name in ("n_kv_heads", "ffn_hidden"):  # None: the family's default
        need(getattr(m, name) is None or getattr(m, name) >= 1,
             f"model.{name}={getattr(m, name)} must be >= 1 (or null for the family's default)")
    if non_finite:  # each range check below would say it again
        return problems
    sized = not problems  # the sizes are >= 1: what divides or compares them can be checked
    if sized and not m.init_from:  # with init_from the HF config defines these; checked again once it is read
        need(m.d_model % m.n_heads == 0, f"model.d_model={m.d_model} must be divisible by model.n_heads={m.n_heads}")
        need(m.n_heads % m.kv_heads == 0,
             f"model.n_heads={m.n_heads} must be divisible by model.n_kv_heads={m.kv_heads}")
        need(m.family == "gpt2" or m.head_dim % 2 == 0 or m.head_dim_ is not None,  # head_dim: _moe_problems
             f"model head dim d_model/n_heads={m.head_dim} must be even for RoPE")
        need(t.seq_len <= m.max_seq_len, f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    problems += _moe_problems(m)
    need(m.norm_eps > 0, f"model.norm_eps={m.norm_eps} must be > 0 (e.g. 1e-5)")
    # below 1 the rotation frequencies theta^(-2i/K) grow past fp32 with the position (NaN from the first step)
    need(m.rope_theta >= 1, f"model.rope_theta={m.rope_theta} must be >= 1 (models use 1e4 to 1e6, e.g. 10000)")
    need(m.sliding_window is None or (isinstance(m.sliding_window, int) and m.sliding_window >= 1),
         f"model.sliding_window={m.sliding_window} must be a number of tokens >= 1, or null for full attention")
    need(m.init_std >= 0, f"model.init_std={m.init_std} must be >= 0 (e.g. 0.02)")
    for sec, name in [(t, "seed"), (d, "seed"), (f, "seed")]:
        need(0 <= getattr(sec, name) < SEED_LIMIT, f"{_sec(sec)}.{name}={getattr(sec, name)} must be in [0, 2**63)")
    need(t.steps >= 0, f"train.steps={t.steps} must be >= 0")
    # a step count is a 64-bit counter: 400 digits trained a step, then the ETA's float overflowed (a traceback)
    need(t.steps < SEED_LIMIT, f"train.steps={clip(str(t.steps))} must be below 2**63")
    need(t.lr >= 0, f"train.lr={t.lr} must be >= 0 (0 keeps the weights frozen)")
    need(0 <= t.min_lr <= t.lr, f"train.min_lr={t.min_lr} must be between 0 and train.lr={t.lr}")
    need(t.warmup_steps >= 0, f"train.warmup_steps={t.warmup_steps} must be >= 0")
    need(t.grad_clip >= 0, f"train.grad_clip={t.grad_clip} must be >= 0 (0 disables clipping)")
    need(t.weight_decay >= 0, f"train.weight_decay={t.weight_decay} must be >= 0 (0 disables it)")
    for name in ("beta1", "beta2"):
        need(0 <= getattr(t, name) < 1, f"train.{name}={getattr(t, name)} must be in [0, 1) (AdamW's default: "
             "0.9 and 0.95)")
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
        need(positive_finite(w),
             f"data.sources[{i}].weight={clip(repr(w))} must be a positive finite number; give every source a "
             "weight > 0")
    weights = [src.get("weight", 1.0) for src in d.sources or [] if isinstance(src, dict)]
    if weights and all(positive_finite(w) for w in weights):
        # shares are weight / sum: a sum that overflows, or a share that rounds to nothing, trained as another blend
        total = sum(float(w) for w in weights)
        need(total < float("inf") and min(weights) / total >= 1e-9,
             f"data.sources: weights {clip(repr(weights))} give a share of {min(weights) / total:.3g} to one source "
             "(or overflow their sum); give weights within a factor of 1e9 of each other, e.g. 1 to 100")
    need(d.num_proc >= 1, f"data.num_proc={d.num_proc} must be >= 1")
    need(bool(d.tokenizer) or bool(m.init_from),
         "data.tokenizer is empty; set it to a tokenizer directory (or set model.init_from)")
    need(r.checkpoint.every >= 0, f"checkpoint.every={r.checkpoint.every} must be >= 0")
    need(r.checkpoint.keep >= 1, f"checkpoint.keep={r.checkpoint.keep} must be >= 1")
    need(r.run.log_every >= 1, f"run.log_every={r.run.log_every} must be >= 1")
    need(0 < r.run.stop_timeout_s <= MAX_STOP_TIMEOUT_S, f"run.stop_timeout_s={r.run.stop_timeout_s:g} must be in "
         f"(0, {MAX_STOP_TIMEOUT_S}] (seconds from SIGTERM to exit)")
    need(r.run.eval_every >= 0, f"run.eval_every={r.run.eval_every} must be >= 0")
    need(r.run.eval_batches >= 1, f"run.eval_batches={r.run.eval_batches} must be >= 1 (run.eval_every=0 turns "
         "evaluation off)")
    need(r.run.sample_tokens >= 0, f"run.sample_tokens={r.run.sample_tokens} must be >= 0 (0 = no sample)")
    need(r.run.peak_tflops is None or r.run.peak_tflops >= 1e-3,  # below, MFU overflows (Infinity in metrics.jsonl)
         f"run.peak_tflops={r.run.peak_tflops} must be >= 0.001 TFLOP/s (or null: from the GPU table)")
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
        # every adapted projection has d_model on one side, and an update B A has rank <= min(in, out): a larger
        # rank adds nothing but adapter memory (a rank of 1e9 asked for terabytes, a traceback at the first step)
        need(m.lora_rank <= m.d_model, f"model.lora_rank={clip(str(m.lora_rank))} must be <= model.d_model="
             f"{m.d_model} (an adapter's update has rank at most min(in, out) of its projection); use e.g. 8 to 64")
        need(m.lora_alpha > 0, f"model.lora_alpha={m.lora_alpha} must be > 0 (the scale is alpha / rank)")
        need(0 <= m.lora_dropout < 1, f"model.lora_dropout={m.lora_dropout} must be in [0, 1)")
        known = lora_projections(m.family, m.is_moe)
        for name in m.lora_targets:
            need(name in known, f"model.lora_targets: {m.family} has no projection {clip(repr(name))}, got "
                 f"{m.lora_targets}; use names from {list(known)}")
    # the optimizer and fault injection (slow ranks inside the world: a layout rule, parallel.mesh.rules)
    need(0 <= t.momentum < 1, f"train.momentum: must be in [0, 1), got {t.momentum}; use 0 or 0.9")
    need(t.optimizer == "sgd" or t.momentum == 0, f"train.momentum: applies to train.optimizer=sgd only, got "
         f"{t.momentum} with {t.optimizer}; set train.optimizer=sgd or drop train.momentum")
    for key, on in (("fp8_emulate", t.fp8_emulate), ("fp8_recipe", t.fp8_recipe != "tensorwise")):
        need(t.precision == "fp8" or not on, f"train.{key}: applies to train.precision=fp8 only, got "
             f"{str(getattr(t, key)).lower()} with {t.precision}; set train.precision=fp8 or drop train.{key}")
    need(all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in f.slow_ranks),
         f"faults.slow_ranks: must list global ranks (integers >= 0), got {f.slow_ranks}")
    need(1 <= f.slow_factor <= MAX_SLOW_FACTOR, f"faults.slow_factor: must be in [1, {MAX_SLOW_FACTOR}] (a slow step "
         f"takes f times its compute), got {f.slow_factor:g}")
    need(0 <= f.slow_prob <= 1, f"faults.slow_prob: must be in [0, 1], got {f.slow_prob}; 1 is persistent")
    if f.kill_rank is not None:
        need(f.kill_rank >= 0, f"faults.kill_rank: must be >= 0, got {f.kill_rank}")
    if f.kill_at_step is not None:
        need(f.kill_at_step >= 1, f"faults.kill_at_step: must be >= 1, got {f.kill_at_step}")
    need((f.kill_rank is None) == (f.kill_at_step is None), "faults.kill_rank and faults.kill_at_step go "
         f"together (got kill_rank={f.kill_rank}, kill_at_step={f.kill_at_step}); set both or neither")
    return problems


def _non_finite(r: Recipe) -> list[str]:
    """A NaN or infinite float in any section, one line each: no key means anything by them, the range checks
    let some through (inf >= 0), and a checkpoint's manifest cannot hold them (its JSON refuses them)."""
    out = []
    for name in SECTIONS:
        section = getattr(r, name)
        for field in dataclasses.fields(section):
            value = getattr(section, field.name)
            if isinstance(value, float) and not math.isfinite(value):
                out.append(f"{name}.{field.name}={value} must be a finite number")
            elif isinstance(value, float) and abs(value) > FLOAT32_MAX:  # lr, outer_lr scale fp32 tensors
                out.append(f"{name}.{field.name}={value:g} is past float32's range ({FLOAT32_MAX:.4g}); use a "
                           "smaller value")
    return out


_EXPERT_KEYS = ("num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
                "router_aux_loss_coef", "router_bias_update_rate")


def _moe_problems(m) -> list[str]:
    """The mixture-of-experts keys (pipetrain.models.moe): one line per problem."""
    out = []
    if m.family in ("mixtral", "qwen3_moe") and m.num_experts == 0:
        out.append(f"model.num_experts: family {m.family} is a mixture of experts, got 0; set it (e.g. 8)")
    if m.head_dim_ is not None and (m.head_dim_ < 2 or m.head_dim_ % 2):
        out.append(f"model.head_dim: must be an even number >= 2 for RoPE, got {m.head_dim_}")
    if m.num_experts < 0:
        out.append(f"model.num_experts: must be >= 0 (0 = dense MLP), got {m.num_experts}")
    if m.num_experts == 0:  # a dense model: an expert key set for it would be ignored, so it is refused
        dense = ModelConfig()  # (with init_from the HF config's num_experts counts: checked again once read)
        ignored = [f"model.{k}={getattr(m, k)}" for k in _EXPERT_KEYS if getattr(m, k) != getattr(dense, k)]
        if ignored and not m.init_from:
            out.append(f"{', '.join(ignored)}: expert keys, but model.num_experts=0 (a dense model); set "
                       "model.num_experts (e.g. 8) or drop them")
        return out
    if m.family == "gpt2":
        out.append("model.num_experts: gpt2 has a GELU MLP; experts are SwiGLU, got family gpt2; use llama, "
                   "mixtral or qwen3_moe")
    if not 1 <= m.num_experts_per_tok <= m.num_experts:
        out.append(f"model.num_experts_per_tok: must be in 1..model.num_experts={m.num_experts}, got "
                   f"{m.num_experts_per_tok}")
    if m.moe_intermediate_size is not None and m.moe_intermediate_size < 1:
        out.append(f"model.moe_intermediate_size: must be >= 1, got {m.moe_intermediate_size}")
    if m.shared_expert_intermediate_size < 0:
        out.append(f"model.shared_expert_intermediate_size: must be >= 0 (0 = none), got "
                   f"{m.shared_expert_intermediate_size}")
    if m.router_aux_loss_coef < 0:
        out.append(f"model.router_aux_loss_coef: must be >= 0 (0 = off), got {m.router_aux_loss_coef}")
    if m.router_bias_update_rate < 0:
        out.append(f"model.router_bias_update_rate: must be >= 0 (0 = off), got {m.router_bias_update_rate}")
    return out


def _sec(obj) -> str:
    return {v: k for k, v in SECTIONS.items()}[type(obj)]


def positive_finite(value) -> bool:
    """A number > 0 that a float holds: an integer of 309 digits passed `< inf`, then overflowed float()."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return 0 < float(value) < float("inf")
    except OverflowError:
        return False
