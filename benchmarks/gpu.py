"""One-GPU benchmark (issue 34): pipetrain against a plain PyTorch loop, transformers and torch.compile, plus the
kernel table, in one command and one run, so every ratio in its output comes from the same card.

    python benchmarks/gpu.py [--full | --model gpt-1b ...] [--only LABEL ...] [--steps 6] [--sequences 16]
                             [--no-kernel-table] [--out gpu-benchmark.md]
    python benchmarks/gpu.py --cpu-smoke      # seconds, any machine: the wiring, not a measurement

Rows (each: tokens/s, MFU against the card's dense bf16 peak, peak GiB, the memory model's
planned peak for a pipetrain row (what the pre-flight check counts), first-step seconds = compile time plus
one step): the pipetrain Trainer as shipped (Triton kernels), with PIPETRAIN_KERNELS=torch, and with the recipe
overrides `train.compile=true` (with the Triton ops and with PIPETRAIN_KERNELS=torch), `train.precision=fp8`
(with and without compile) and `train.fused_loss=true` and `=false` (whatever "auto" makes of the vocabulary); the
same model in a plain PyTorch loop (torch kernels, fused AdamW, bf16 autocast), torch.compile of that loop, and
transformers' model (sdpa). A pipetrain row whose override the recipe refuses (a key this checkout does not have)
reads "unsupported: <the recipe's error>"; a row that runs out of memory says so. Data: synthetic tokens drawn on
the device (no dataset, no network). Default: the llama 1.0B model of issue 34 at seq 2048, 16 sequences a step
(under 5 minutes on one H100/H200); --full adds the gpt-1b recipe's model and a llama 1.5B with vocab 128,256,
and rows of fp8 with rowwise scales (train.fp8_recipe=rowwise, and rowwise_with_gw_hp) and compile (an --only
naming one runs it too).
With nvidia-smi on PATH each row also gets the card's SM clock, board power and temperature during its timed
steps (benchmarks/clocks.py). MFU counts the model FLOPs of pipetrain.models.flops_per_token (docs/mfu.md) against
the bf16 peak of pipetrain.metrics.GPU_PEAK_TFLOPS, fp8 rows included (so an fp8 row's MFU can exceed what bf16 allows).
Without CUDA it says it needs a GPU and exits 0, running and writing nothing. With --cpu-smoke a tiny model
runs 2 steps per row on the CPU in fp32, compile rows with the
"eager" backend (the plain loop) and "aot_eager" (train.compile): it checks that every row runs, the profile is
taken and the file is written; its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import os
import statistics
import sys
import time
import traceback

import numpy as np
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pipetrain.build import build_trainer  # noqa: E402
from pipetrain.config import ConfigError, ModelConfig, load_recipe  # noqa: E402
from pipetrain.data import Loader, PackedData  # noqa: E402
from pipetrain.metrics import peak_tflops  # noqa: E402
from pipetrain.models import build, flops_per_token, materialize  # noqa: E402
from pipetrain.models.compile import BACKEND_ENV  # noqa: E402
from pipetrain.plan.memory import rank_memory  # noqa: E402


def _load_benchmark(name: str):
    """benchmarks/<name>.py as a module, without putting benchmarks/ on sys.path (its kernels.py would shadow
    the kernels package)."""
    spec = importlib.util.spec_from_file_location(f"pipetrain_bench_{name}", os.path.join(ROOT, "benchmarks",
                                                                                         f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


step_profile = _load_benchmark("step_profile")
clocks = _load_benchmark("clocks")

TINY_RECIPE = os.path.join(ROOT, "recipes", "tiny.yaml")
LLAMA_1B = dict(family="llama", vocab_size=8192, d_model=2048, n_layers=16, n_heads=16, n_kv_heads=8,
                ffn_hidden=8192, max_seq_len=2048, tie_embeddings=False)
GPT_1B = dict(family="gpt2", vocab_size=50304, d_model=2048, n_layers=24, n_heads=16, n_kv_heads=None,
              ffn_hidden=None, max_seq_len=2048, tie_embeddings=True)  # None: the family's default (null)
LLAMA_1B5_BIG_VOCAB = dict(LLAMA_1B, vocab_size=128256)  # 1.53B: the llama 1.0B with a 128k vocab
# the llama 1.0B's attention with 8 experts of ffn 2048, top 2 (mixtral's routing): 1.85B, 0.64B active
MOE_2B = dict(LLAMA_1B, family="mixtral", ffn_hidden=None, num_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=2048, router_aux_loss_coef=0.01)
# --model NAME: (table heading, model keys)
MODELS = {"llama-1b": ("llama 1.0B (d 2048, 16 layers, GQA 16/8, ffn 8192, vocab 8192)", LLAMA_1B),
          "gpt-1b": ("gpt-1b recipe's model (GPT-2 arch, 1.3B, vocab 50304)", GPT_1B),
          "llama-1b5": ("llama 1.5B, vocab 128,256", LLAMA_1B5_BIG_VOCAB),
          "moe": ("mixtral-style MoE 1.85B, 0.64B active (the llama 1.0B's attention, 8 experts of ffn 2048, top 2)",
                  MOE_2B)}
SMOKE = dict(family="llama", vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128,
             max_seq_len=32, tie_embeddings=False)
SMOKE_MOE = dict(SMOKE, family="mixtral", ffn_hidden=None, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=64)
# (label, kind, recipe overrides or None); kind: pipetrain | pipetrain-torch | plain | compiled | hf.
# In order of what issue 34's targets need, so a run cut short by a time limit has those rows (each row is
# printed, and the file rewritten, as it finishes).
ROWS = [
    ("pipetrain Trainer (Triton kernels)", "pipetrain", []),
    ("pipetrain, train.compile=true", "pipetrain", ["train.compile=true"]),
    # before the compiled plain loop, whose compile took up to 54 s on the H200: a step cut short at that
    # row kept no fp8 row (2026-11-28)
    ("pipetrain, train.precision=fp8 + train.compile=true", "pipetrain", ["train.precision=fp8", "train.compile=true"]),
    ("torch.compile of the plain loop", "compiled", None),
    # the fused loss on and off whatever "auto" makes of the model's vocabulary (config.fused_loss_on)
    ("pipetrain, train.fused_loss=true", "pipetrain", ["train.fused_loss=true"]),
    ("pipetrain, train.fused_loss=false", "pipetrain", ["train.fused_loss=false"]),
    # the Triton ops as custom ops inside the compiled blocks (above) against inductor's own fusions of the
    # torch references: which is faster under compile (docs/compile.md)
    ("pipetrain, train.compile=true + PIPETRAIN_KERNELS=torch", "pipetrain-torch", ["train.compile=true"]),
    # fp8 with inductor's own norm and SwiGLU: it may fuse them with the amax and the cast that follow
    ("pipetrain, train.precision=fp8 + train.compile=true + PIPETRAIN_KERNELS=torch", "pipetrain-torch",
     ["train.precision=fp8", "train.compile=true"]),
    ("the same model in a plain PyTorch loop", "plain", None),
    ("pipetrain, train.precision=fp8", "pipetrain", ["train.precision=fp8"]),
    ("pipetrain, PIPETRAIN_KERNELS=torch", "pipetrain-torch", []),
    ("transformers (sdpa)", "hf", None),
]
# --full's rows too (or one an --only names): rowwise fp8 scales (train.fp8_recipe=rowwise and rowwise_with_gw_hp,
# docs/fp8.md), whose cost against tensorwise no target names, left out of the default's 5 minutes
FULL_ROWS = [
    (f"pipetrain, train.precision=fp8 + train.fp8_recipe={recipe} + train.compile=true", "pipetrain",
     ["train.precision=fp8", f"train.fp8_recipe={recipe}", "train.compile=true"])
    for recipe in ("rowwise", "rowwise_with_gw_hp")
] + [
    # An experiment for the compile / eager target (1.079x of 1.10 on the gpt-1b's model, H200): inductor's
    # coordinate-descent tuning of its own kernels' launch configurations (the LayerNorm, GELU and residual
    # fusions: 75 ms of the compiled step's 506), which GPT-2 speed runs turn on. An "inductor." override is
    # torch._inductor.config's, set for the row alone (_inductor_config), not a recipe key; train.compile would
    # take it up only where a GPU measured it faster.
    ("pipetrain, train.compile=true + inductor.coordinate_descent_tuning", "pipetrain",
     ["train.compile=true", "inductor.coordinate_descent_tuning=true"]),
    # The second experiment: torch.compile's mode "max-autotune-no-cudagraphs" (max_autotune and
    # coordinate_descent_tuning), which benchmarks inductor's Triton GEMM templates against cuBLAS for each of
    # the block's GEMM shapes and keeps the faster; where a template wins, the bias, GELU and residual add that
    # follow it fuse into its epilogue (the compiled step's GEMMs are 351 of its 506 ms). Its first step
    # autotunes: a longer compile, bought once per run.
    ("pipetrain, train.compile=true + inductor.max_autotune", "pipetrain",
     ["train.compile=true", "inductor.max_autotune=true", "inductor.coordinate_descent_tuning=true"]),
]
EAGER, BF16_COMPILE, FP8_COMPILE, PLAIN_COMPILE = (ROWS[i][0] for i in range(4))
FP8_COMPILE_TORCH = "pipetrain, train.precision=fp8 + train.compile=true + PIPETRAIN_KERNELS=torch"
# two more steps under torch.profiler (benchmarks/step_profile.py), with their TOP_KERNELS longest kernels:
# the two compile rows issue 34 needs a profile of (what caps fp8), and with --diagnose also fp8 with inductor's
# own kernels, the compiled plain loop (what pipetrain's compile is up against) and pipetrain eager (its
# baseline), which the default's 5 minutes leave out
PROFILED = (BF16_COMPILE, FP8_COMPILE)
DIAGNOSED = PROFILED + (FP8_COMPILE_TORCH, PLAIN_COMPILE, EAGER)
# 30: the gpt-1b compile row's top 15 covered 44 of its 75 ms of elementwise kernels (H200, 2026-11-28)
TOP_KERNELS = 30


@dataclasses.dataclass
class Setup:
    device: torch.device
    dtype: torch.dtype           # autocast dtype of the baselines (bf16; fp32 on the CPU smoke)
    seq_len: int
    batch: int                   # sequences per step
    steps: int                   # measured steps, after 2 warm-up steps
    smoke: bool
    profiled: tuple = PROFILED   # labels of the rows profiled after their timed steps

    @property
    def tokens(self) -> int:
        return self.seq_len * self.batch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(step, setup: Setup) -> tuple[float, float, dict | None]:
    """(first step's seconds, median seconds of `steps` steps after two warm-up steps, the card's clocks during
    those steps: benchmarks/clocks.py, None without nvidia-smi)."""
    times = []
    sampler = clocks.ClockSampler(clocks.gpu_id(setup.device))
    with contextlib.ExitStack() as measuring:
        for i in range(2 + setup.steps):
            _sync(setup.device)
            if i == 2:
                measuring.enter_context(sampler)
            t0 = time.perf_counter()
            step()
            _sync(setup.device)
            times.append(time.perf_counter() - t0)
    return times[0], statistics.median(times[2:]), sampler.summary


def _tokens(vocab: int, setup: Setup, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (setup.batch, setup.seq_len + 1), generator=g).to(setup.device)


def _pipetrain_row(model: dict, overrides: list[str], setup: Setup, out_dir: str):
    """The Trainer built by build_trainer from the tiny recipe with this model and overrides, on synthetic tokens."""
    keys = [f"model.{k}={'null' if v is None else v}" for k, v in model.items()] + [
        f"train.seq_len={setup.seq_len}", f"train.global_batch={setup.batch}", f"train.steps={setup.steps + 2}",
        f"train.precision={'bf16' if not setup.smoke else 'fp32'}", "train.warmup_steps=1",
        "parallel.microbatches=1", f"run.output_dir={out_dir}", "run.progress=false", "run.eval_every=0",
        "run.sample_tokens=0", "checkpoint.every=0"]
    recipe = load_recipe(TINY_RECIPE, keys + overrides)  # ConfigError: the row is unsupported
    _check_overrides(recipe, overrides)
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(0)
    num = setup.batch * (setup.seq_len + 1) * 4
    data = PackedData(rng.integers(0, recipe.model.vocab_size, num).astype(np.int32), np.ones(num, dtype=bool),
                      setup.seq_len, 0.0, 0)
    trainer = build_trainer(recipe, loader=Loader(data, setup.batch, 0, 1))
    # the memory model's peak for this run (what the pre-flight check and the planner count), beside the measured
    planned = max(r.total for r in rank_memory(recipe, 1, staged_collectives=setup.device.type == "cpu",
                                               device_type=setup.device.type)) / 2**30
    return trainer.train_step, recipe.model, planned


def _check_overrides(recipe, overrides: list[str]) -> None:
    """Raise unless every override of the row's label holds in the recipe it runs (a row measures what its label
    says: an fp8 row whose train.precision a base key overrode would compare bf16 with bf16)."""
    alone = load_recipe(TINY_RECIPE, overrides)
    for item in overrides:
        section, key = item.split("=", 1)[0].split(".", 1)
        got, want = getattr(getattr(recipe, section), key), getattr(getattr(alone, section), key)
        if got != want:
            raise RuntimeError(f"the row's override {item} did not take: {section}.{key} is {got!r}")


def _loop_row(model: dict, kind: str, setup: Setup):
    """One training step of a plain loop: the pipetrain decoder (or transformers' model), fused AdamW, autocast."""
    cfg = ModelConfig(**model)
    if kind == "hf" and cfg.is_moe:
        raise ConfigError("the transformers row builds dense models only")
    if kind == "hf":
        with setup.device:  # initialise on the device: a 1B model's CPU init takes longer than its steps
            net = _hf_model(cfg)
    else:
        net = materialize(build(cfg), cfg, 0, setup.device)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=setup.device.type == "cuda")
    forward = net
    if kind == "compiled":
        forward = torch.compile(net, backend="eager" if setup.smoke else "inductor")
    batch = _tokens(cfg.vocab_size, setup)
    inputs, targets = batch[:, :-1], batch[:, 1:]

    def step():
        with torch.autocast(setup.device.type, dtype=setup.dtype, enabled=not setup.smoke):
            out = forward(inputs)
            logits = out.logits if kind == "hf" else out
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    return step, cfg


def _hf_model(cfg: ModelConfig):
    import transformers as tf  # deferred: heavy, and only the transformers row needs it

    if cfg.family == "gpt2":
        hf = tf.GPT2Config(vocab_size=cfg.vocab_size, n_embd=cfg.d_model, n_layer=cfg.n_layers, n_head=cfg.n_heads,
                           n_positions=cfg.max_seq_len, attn_implementation="sdpa")
        return tf.GPT2LMHeadModel(hf)
    hf = tf.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn,
                        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                        num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.max_seq_len,
                        tie_word_embeddings=cfg.tied, attn_implementation="sdpa")
    return tf.LlamaForCausalLM(hf)


@contextlib.contextmanager
def _kernels_env(value: str | None):
    old = os.environ.get("PIPETRAIN_KERNELS")
    if value is not None:
        os.environ["PIPETRAIN_KERNELS"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PIPETRAIN_KERNELS", None)
        else:
            os.environ["PIPETRAIN_KERNELS"] = old


def _split_inductor(overrides) -> tuple[list[str] | None, dict]:
    """(the recipe overrides, the torch._inductor.config settings) of a row's overrides: "inductor.NAME=VALUE"
    items are inductor's (true / false, or a number), the rest recipe keys."""
    if overrides is None:
        return None, {}
    settings = {}
    for item in overrides:
        if item.startswith("inductor."):
            name, value = item.removeprefix("inductor.").split("=", 1)
            settings[name] = {"true": True, "false": False}.get(value.lower(), None)
            if settings[name] is None:
                settings[name] = float(value) if "." in value else int(value)
    return [item for item in overrides if not item.startswith("inductor.")], settings


@contextlib.contextmanager
def _inductor_config(settings: dict):
    """torch._inductor.config patched with settings for the block (nothing imported when there are none)."""
    if not settings:
        yield
        return
    import torch._inductor.config as inductor_config
    with inductor_config.patch(settings):
        yield


def run_row(model: dict, label: str, kind: str, overrides, setup: Setup, out_dir: str, peak: float | None) -> dict:
    """One row of the table: its numbers, or its status (unsupported, out of memory, failed)."""
    row = {"implementation": label}
    overrides, inductor_settings = _split_inductor(overrides)
    if setup.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(setup.device)
    # dynamo's caches outlive a model: without a reset a row would reuse an earlier row's compiled graph (its
    # guards do not read PIPETRAIN_KERNELS), and its first step would not include compiling
    torch._dynamo.reset()
    counters.clear()
    try:
        with _kernels_env("torch" if kind in ("pipetrain-torch", "plain", "compiled") else None), \
                _inductor_config(inductor_settings):
            if kind.startswith("pipetrain"):
                step, cfg, row["planned_gib"] = _pipetrain_row(model, overrides, setup, out_dir)
            else:
                step, cfg = _loop_row(model, kind, setup)
            first, median, row["clocks"] = _timed(step, setup)
            graphs = counters["stats"]["unique_graphs"]
            if label in setup.profiled:
                try:
                    row["profile"], row["top"], row["idle"], row["timeline"] = step_profile.profile_step(
                        step, setup.device, top=TOP_KERNELS)
                except Exception as exc:  # noqa: BLE001  (a profiler problem must not cost the row)
                    row["profile_error"] = f"{type(exc).__name__}: {exc}"[:200]
    except ConfigError as exc:
        return {**row, "status": f"unsupported: {str(exc).split(';')[0][:120]}"}  # the recipe's own words
    except torch.cuda.OutOfMemoryError:
        return {**row, "status": "out of memory"}
    except Exception as exc:  # noqa: BLE001  (one row's failure must not cost the rows after it)
        traceback.print_exc()
        first_line = (str(exc).splitlines() or [""])[0][:150]
        return {**row, "status": f"failed: {type(exc).__name__}: {first_line}"}
    finally:
        step = None
        gc.collect()
    tok_s = setup.tokens / median
    on_cuda = setup.device.type == "cuda"
    row.update(tokens_per_s=tok_s, first_step_s=first, step_s=median, graphs=graphs,
               peak_gib=torch.cuda.max_memory_allocated(setup.device) / 2**30 if on_cuda else None)
    if peak:
        row["mfu"] = flops_per_token(cfg, setup.seq_len) * tok_s / (peak * 1e12)
    return row


def format_model_table(name: str, rows: list[dict], peak: float | None) -> list[str]:
    """graphs: the graphs torch.compile made for the row (0: eager), its first step's seconds include compiling
    them. planned GiB: pipetrain.plan.memory's peak for a pipetrain row's recipe (the pre-flight check's figure)."""
    mfu_head = f"MFU ({peak:g} TFLOP/s)" if peak else "MFU"
    lines = [f"| model | implementation | tokens/s | {mfu_head} | peak GiB | planned GiB | first step s | graphs |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for i, r in enumerate(rows):
        model = name if i == 0 else ""
        if "status" in r:
            lines.append(f"| {model} | {r['implementation']} | {r['status']} | | | | | |")
            continue
        mfu = f"{r['mfu']:.1%}" if "mfu" in r else "n/a"
        gib = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "n/a"
        planned = "n/a" if r.get("planned_gib") is None else (  # 3 digits below 1 GiB: the CPU smoke's d-64 model
            f"{r['planned_gib']:.1f}" if r["planned_gib"] >= 1 else f"{r['planned_gib']:.3g}")
        lines.append(f"| {model} | {r['implementation']} | {r['tokens_per_s']:,.0f} | {mfu} | {gib} | {planned} | "
                     f"{r['first_step_s']:.1f} | {r['graphs']} |")
    return lines


# Issue 34's targets, each a ratio of two rows of the same run: (numerator, denominator, target)
RATIOS = [("pipetrain, train.compile=true", "pipetrain Trainer (Triton kernels)", 1.10),
          ("pipetrain, train.compile=true", "torch.compile of the plain loop", 1.0),
          ("pipetrain, train.precision=fp8 + train.compile=true", "pipetrain, train.compile=true", 1.2),
          ("pipetrain, train.compile=true + PIPETRAIN_KERNELS=torch", "pipetrain, train.compile=true", None),
          ("pipetrain, train.precision=fp8 + train.compile=true + PIPETRAIN_KERNELS=torch",
           "pipetrain, train.compile=true", None),
          ("pipetrain, train.precision=fp8", "pipetrain Trainer (Triton kernels)", None),
          ("pipetrain, train.fused_loss=true", "pipetrain, train.fused_loss=false", None),
          (FULL_ROWS[0][0], "pipetrain, train.precision=fp8 + train.compile=true", None),
          (FULL_ROWS[1][0], FULL_ROWS[0][0], None),
          (FULL_ROWS[2][0], "pipetrain Trainer (Triton kernels)", None),  # the experiment against 1.10x
          (FULL_ROWS[2][0], "pipetrain, train.compile=true", None),
          (FULL_ROWS[3][0], "pipetrain Trainer (Triton kernels)", None),  # the second experiment
          (FULL_ROWS[3][0], "pipetrain, train.compile=true", None),
          ("pipetrain Trainer (Triton kernels)", "the same model in a plain PyTorch loop", None)]


def format_ratios(rows: list[dict]) -> list[str]:
    """tokens/s ratios between rows of this run (n/a where either row did not run), against issue 34's targets."""
    speed = {r["implementation"]: r.get("tokens_per_s") for r in rows}
    lines = []
    for top, bottom, target in RATIOS:
        ratio = speed[top] / speed[bottom] if speed.get(top) and speed.get(bottom) else None
        value = "n/a" if ratio is None else f"{ratio:.3f}x"  # 3 places: 1.195 must not read as 1.20
        goal = ""
        if target:
            verdict = "" if ratio is None else (": met" if ratio >= target else ": missed")
            goal = f" (target >= {target:.2f}x{verdict})"
        lines.append(f"- {top} / {bottom}: {value}{goal}")
    return lines


def format_profile_section(rows: list[dict]) -> list[str]:
    """Where the compile rows' steps go, and the most fp8 could give: issue 34 asks for this when fp8 + compile
    gains less than 1.2x over bf16 + compile."""
    profiles = {r["implementation"]: r["profile"] for r in rows if "profile" in r}
    lines = [f"- {r['implementation']}: profile failed ({r['profile_error']})" for r in rows if "profile_error" in r]
    if not profiles:
        return lines
    lines = ["Where a step's time goes (2 more steps under torch.profiler; categories by kernel name, "
             "benchmarks/step_profile.py; step: the timed steps' median; GPU busy: the time a kernel ran in "
             "the profiled steps, GPU idle: those steps' wall time less that):", "",
             *step_profile.format_profiles(profiles, {r["implementation"]: r["step_s"] for r in rows
                                                      if "profile" in r},
                                           {r["implementation"]: r["timeline"] for r in rows
                                            if r.get("timeline") is not None}),
             "", *lines]
    bf16 = profiles.get(BF16_COMPILE)
    if bf16 and sum(bf16.values()):
        share = bf16["gemm"] / sum(bf16.values())
        lines.append(f"- {BF16_COMPILE}: GEMMs are {share:.0%} of the kernel time, so GEMMs at fp8's 2x peak and "
                     f"nothing else faster give at most {step_profile.amdahl_bound(share):.2f}x (Amdahl)")
    for r in rows:
        if r.get("top"):
            lines += ["", *step_profile.format_top_kernels(r["implementation"], r["top"])]
        if r.get("idle") is not None:
            lines += ["", *step_profile.format_idle(r["implementation"], r["idle"])]
    return lines


def kernel_table(setup: Setup, repeats: int) -> list[str]:
    """benchmarks/kernels.py's table (its cases and measurement), on the GPU; the agreement check on the CPU."""
    bench = _load_benchmark("kernels")
    if setup.device.type != "cuda":
        return ["kernel table: needs a CUDA GPU (benchmarks/kernels.py); not measured in --cpu-smoke"]
    lines = [f"kernels at llama-3-8B shapes {bench.FULL}, bf16, median of {repeats} forward+backward",
             "", "| op | impl | ms | peak MiB | time vs eager | memory vs eager |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for name, leaves, extra, tri, ref in bench._cases(bench.FULL, "cuda", torch.bfloat16):
        leaves = [x.requires_grad_() for x in leaves]
        rows = {impl: bench._measure(fn, leaves, extra, 3, repeats)
                for impl, fn in (("eager", ref), ("compile", torch.compile(ref)), ("triton", tri))}
        for impl, (ms, mib) in rows.items():
            lines.append(f"| {name} | {impl} | {ms:.3f} | {mib:.0f} | {ms / rows['eager'][0]:.2f} | "
                         f"{mib / max(rows['eager'][1], 1e-9):.2f} |")
    return lines


def selected_models(names: list[str], full: bool, smoke: bool) -> list[tuple[str, dict]]:
    """(table heading, model keys) of each model to run: --model's in its order, else llama-1b (--full: all
    of them); the CPU smoke's tiny llama whatever was asked (its tiny MoE where the MoE was)."""
    if smoke:
        return [("llama (cpu smoke: d 64, 2 layers)", SMOKE)] + (
            [("MoE (cpu smoke: d 64, 2 layers, 4 experts)", SMOKE_MOE)] if "moe" in names else [])
    return [MODELS[n] for n in names or (list(MODELS) if full else ["llama-1b"])]


def _spaced(section: list[str]) -> list[str]:
    return ["", *section] if section else []


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true",
                        help="also the gpt-1b recipe's model, a llama 1.5B with vocab 128k and the MoE, and the "
                             "rowwise fp8 rows")
    parser.add_argument("--model", action="append", default=[], choices=list(MODELS),
                        help="run this model's rows (repeatable, in the order given); default: llama-1b "
                             "(--full: all of them)")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per row, after 2 warm-up steps")
    parser.add_argument("--sequences", type=int, default=16,
                        help="sequences of 2048 tokens a step (16: issue 34's table; fewer lets --full's gpt-1b "
                             "rows fit an 80 GB card, whose eager row needed 82 GiB at 16)")
    parser.add_argument("--kernel-repeats", type=int, default=10)
    parser.add_argument("--out", default="gpu-benchmark.md", help="markdown file the tables are written to")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU: the wiring only")
    parser.add_argument("--only", action="append", default=[], metavar="LABEL",
                        help="run only the row with this label, as the table writes it (repeatable); default: all")
    parser.add_argument("--no-kernel-table", action="store_true", help="skip benchmarks/kernels.py's table")
    parser.add_argument("--diagnose", action="store_true",
                        help="also profile pipetrain eager, the compiled plain loop and fp8 with inductor's kernels "
                             "(where the compile gap goes), which the default leaves out to stay within 5 minutes")
    parser.add_argument("--work-dir", default="/tmp/pipetrain-gpu-bench", help="the Trainer rows' run.output_dir")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.only) - {label for label, _, _ in ROWS + FULL_ROWS})
    if unknown:
        parser.error(f"--only {unknown[0]!r} is no row's label; the labels: "
                     + "; ".join(r[0] for r in ROWS + FULL_ROWS))
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA GPU (an H100 or H200 for issue 34's table) and found none; nothing "
              "was run or written. --cpu-smoke checks its wiring on this machine (numbers meaningless)")
        return 0
    smoke = args.cpu_smoke
    if smoke:  # train.compile's rows trace as inductor does but run eager kernels: seconds, not minutes
        os.environ[BACKEND_ENV] = "aot_eager"
    device = torch.device("cpu" if smoke else "cuda")
    setup = Setup(device, torch.float32 if smoke else torch.bfloat16, 32 if smoke else 2048,
                  2 if smoke else args.sequences,
                  2 if smoke else args.steps, smoke, DIAGNOSED if args.diagnose else PROFILED)
    models = selected_models(args.model, args.full, smoke)
    peak = peak_tflops(device, None)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke: numbers mean nothing)"
    header = [f"# benchmarks/gpu.py on {card}", "",
              f"torch {torch.__version__}; seq {setup.seq_len}, {setup.batch} sequences a step, median of "
              f"{setup.steps} steps after 2 warm-up steps; synthetic tokens; one process", ""]
    lines = list(header)
    print("\n".join(header), flush=True)

    def write(more: list[str]) -> None:  # after every row: a run cut short keeps what it measured
        with open(args.out, "w") as f:
            f.write("\n".join(lines + more) + "\n")

    for name, model in models:
        rows = []
        for label, kind, overrides in ROWS + (FULL_ROWS if args.full or args.only else []):
            if args.only and label not in args.only:
                continue
            rows.append(run_row(model, label, kind, overrides, setup, os.path.join(args.work_dir, kind), peak))
            done = rows[-1]
            result = done["status"] if "status" in done else f"{done['tokens_per_s']:,.0f} tok/s"
            print(f"  {label}: {result}", flush=True)
            table = [*format_model_table(name, rows, peak), "", *format_ratios(rows),
                     *_spaced(clocks.format_clocks(rows, [(top, bottom) for top, bottom, _ in RATIOS])), "",
                     *format_profile_section(rows)]
            write(table)
        print("\n".join(table), flush=True)
        lines += table + [""]
    kernels = [] if args.no_kernel_table else kernel_table(setup, args.kernel_repeats)
    print("\n".join(kernels), flush=True)
    lines += kernels
    write([])
    print(f"written: {os.path.abspath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
