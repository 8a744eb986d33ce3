"""Step metrics: metrics.jsonl (global rank 0), console feedback, optional trackers, MFU.

metrics.jsonl is a contract (DESIGN.md): every optimizer step writes step, loss, lr, grad_norm,
tokens (cumulative), tokens_per_sec, step_time_s, peak_mem_bytes, and mfu when a peak FLOP rate is
known; a mixture-of-experts model adds expert_load_max and expert_load_mean (lists, one entry per layer:
the largest and the mean tokens per expert of the step's global batch) and, with router_aux_loss_coef > 0,
aux_loss (the balance term added to the objective, not part of loss); evaluations write step,
eval_loss, eval_tokens. The console shows a start-up banner, a line
every run.log_every steps (step/total, elapsed, ETA; a progress bar instead when stderr is a
terminal), a line per checkpoint saved and per evaluation, and a summary at the end.

Trackers (run.trackers) are opt-in optional extras: tensorboard writes OUTPUT_DIR/tensorboard;
wandb logs to Weights & Biases, offline (files under OUTPUT_DIR/wandb) unless WANDB_API_KEY or
WANDB_MODE says otherwise, so a run never blocks on a login prompt.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import resource
import statistics
import sys
import time

import torch

from pipetrain.config import ConfigError, Recipe
from pipetrain.plan.memory import rank_memory
from pipetrain.plan.shapes import model_params

# Dense bf16 tensor-core peaks (TFLOP/s per device, no sparsity) from the vendors' data sheets (the RTX 4090's
# with fp32 accumulation, Ada's whitepaper). peak_tflops takes the first key the card's name holds, so a key
# that holds another comes before it ("L40S", "L40" before "L4"; "H100 PCIe" before "H100").
GPU_PEAK_TFLOPS = {
    "H200": 989.0, "H100 SXM": 989.0, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.0,
    "H800 PCIe": 756.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "A10G": 70.0, "A10": 125.0,
    "L40S": 362.0, "L40": 181.05, "L4": 121.0, "4090": 165.2, "V100": 125.0, "B200": 2250.0,
}
# Steps of a process left out of its steady-state throughput: the first compiles the blocks under
# train.compile (and allocates, fills caches and autotunes without it); the second can still recompile
# (a first backward with gradients present, the LR past warm-up).
WARMUP_STEPS = 2
TRACKERS = ("tensorboard", "wandb")  # each is both the module to import and the pyproject extra


def peak_tflops(device: torch.device, configured: float | None) -> float | None:
    """Peak TFLOP/s of one device: run.peak_tflops, else the GPU table, else None (no MFU)."""
    if configured:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_PEAK_TFLOPS.items():  # the first key the name holds (the table orders them)
            if key in name:
                return value
    return None


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory on CUDA; peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def format_duration(seconds: float) -> str:
    """45s, 3m12s, 2h05m."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _installed(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None  # None: an import known to fail
    return importlib.util.find_spec(module) is not None


def check_trackers(names) -> None:
    """ConfigError naming the pip extra for the first tracker asked for whose package is missing."""
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"run.trackers: unknown tracker, got {name!r}; use any of {', '.join(TRACKERS)}")
        if not _installed(name):
            raise ConfigError(f"run.trackers: {name} is asked for but not installed; install the extra with "
                              f"pip install -e \".[{name}]\" or remove {name} from run.trackers")


def _scalars(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}


class TensorBoardTracker:
    def __init__(self, output_dir: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter  # optional extra: imported only when asked for
        self.writer = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        self.writer.add_text("recipe", "```\n" + json.dumps(config, indent=1) + "\n```", 0)

    def log(self, record: dict) -> None:
        for key, value in _scalars(record).items():
            self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, output_dir: str, config: dict):
        import wandb  # optional extra: imported only when asked for (slow to import)
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "pipetrain"),
                              name=os.path.basename(os.path.abspath(output_dir)), dir=output_dir,
                              config=config, mode=mode)

    def log(self, record: dict) -> None:
        self.run.log(_scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


def build_trackers(names, output_dir: str, config: dict) -> list:
    check_trackers(names)
    kinds = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker}
    return [kinds[name](output_dir, config) for name in names]


def steady_tokens_per_sec(rates: list[float], warmup: int = WARMUP_STEPS) -> float | None:
    """Median of the per-step tokens/s after the first `warmup` steps; None when no step comes after them.
    The median, not the mean: one slow step (a checkpoint's flush, a neighbour on a shared machine) does
    not move it, and the compile step is left out instead of averaged in."""
    after = rates[warmup:]
    return statistics.median(after) if after else None


class MetricsLogger:
    """Writes metrics on global rank 0 only; every other rank's calls are no-ops (save_checkpoint
    still saves on every rank)."""

    def __init__(self, output_dir: str, enabled: bool, total_steps: int, progress: bool, start_step: int = 0,
                 log_every: int = 1, trackers=(), config: dict | None = None, tokens_per_step: int = 0):
        check_trackers(trackers)  # on every rank, so every rank stops with the same one-line error
        self.enabled, self.total_steps, self.log_every = enabled, total_steps, log_every
        self.start_step, self.tokens_per_step = start_step, tokens_per_step
        self.started = time.perf_counter()
        self.last_step: dict | None = None
        self.last_eval: dict | None = None
        self.step_rates: list[float] = []  # tokens_per_sec of each step this process logged
        self.file = open(os.path.join(output_dir, "metrics.jsonl"), "a") if enabled else None
        self.trackers = build_trackers(trackers, output_dir, config or {}) if enabled else []
        self.bar = None
        if enabled and progress and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    @classmethod
    def from_recipe(cls, recipe: Recipe, output_dir: str, enabled: bool, start_step: int = 0) -> "MetricsLogger":
        run, train = recipe.run, recipe.train
        return cls(output_dir, enabled, train.steps, run.progress, start_step, run.log_every, run.trackers,
                   recipe.to_dict(), train.global_batch * train.seq_len)

    # -- records -----------------------------------------------------------------------------------
    def log(self, record: dict) -> None:
        """Write one record to metrics.jsonl and the trackers; print steps every log_every (and the last)."""
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        for tracker in self.trackers:
            tracker.log(record)
        step = record["step"]
        if "loss" in record:
            self.last_step = record
            self.step_rates.append(record["tokens_per_sec"])
            if self.bar is not None:
                self.bar.update(step - self.bar.n)
                self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                                     tok_s=f"{record['tokens_per_sec']:.0f}")
            elif step % self.log_every == 0 or step == self.total_steps:
                self.print_line(record)
        elif "eval_loss" in record:
            self.last_eval = record
            self.print_line(record)

    def print_line(self, record: dict) -> None:
        if "loss" in record:
            extra = f" | mfu {record['mfu']:.1%}" if "mfu" in record else ""
            elapsed = time.perf_counter() - self.started
            done = record["step"] - self.start_step
            eta = elapsed / done * (self.total_steps - record["step"]) if done > 0 else 0.0
            self.write(f"step {record['step']:>{len(str(self.total_steps))}}/{self.total_steps} | "
                       f"loss {record['loss']:.4f} | lr {record['lr']:.2e} | grad norm {record['grad_norm']:.3f} | "
                       f"{record['tokens_per_sec']:.0f} tok/s{extra} | elapsed {format_duration(elapsed)} | "
                       f"eta {format_duration(eta)}")
        elif "eval_loss" in record:
            self.write(f"eval at step {record['step']}: loss {record['eval_loss']:.4f} | "
                       f"perplexity {_perplexity(record['eval_loss']):.2f} | {record['eval_tokens']} tokens")

    # -- run events --------------------------------------------------------------------------------
    def banner(self, recipe: Recipe, dims, start_step: int = 0) -> None:
        """What is about to run: model and size, layout per axis, tokens per step, output and start point."""
        self.started = time.perf_counter()
        if not self.enabled:
            return
        m, p, t = recipe.model, recipe.parallel, recipe.train
        params = model_params(m)
        source = f" from {m.init_from}" if m.init_from else ""
        experts = f", {m.num_experts} experts top {m.num_experts_per_tok}" if m.is_moe else ""
        self.write(f"model: {m.family}{source}, {params:,} parameters ({m.n_layers} layers, d_model {m.d_model}, "
                   f"{m.n_heads} heads, vocab {m.vocab_size}{experts})")
        pipeline = f" | schedule {p.schedule}" + (f" x{p.virtual_stages} virtual" if p.virtual_stages > 1 else "")
        cp = f" x cp {dims.cp}" if dims.cp > 1 else ""
        ep = f" (experts over ep {dims.ep} of the dp ranks)" if dims.ep > 1 else ""
        self.write(f"layout: {dims.world_size} rank(s) = dp {dims.dp} x tp {dims.tp} x pp {dims.pp}{cp}{ep} | "
                   f"zero {p.zero} | {p.microbatches} microbatch(es){pipeline if dims.pp > 1 else ''} | "
                   f"recompute {p.recompute}{' | sequence parallel' if p.sequence_parallel else ''} | "
                   f"{t.precision} on {dims.device.type}")
        if dims.dp_replicate > 1:
            dynamic = (f" | dynamic batch ON: the split follows measured speed, re-measured every "
                       f"{p.dynamic_batch_every} steps" if p.dynamic_batch else "")
            self.write(f"replicas: {dims.dp_replicate} x dp_shard {dims.dp_shard} | dp_sync {p.dp_sync}{dynamic}")
        if getattr(dims, "ps_servers", 0):
            rows = -(-m.vocab_size // dims.ps_servers)
            bound = f" (staleness {p.staleness})" if p.ps_sync == "ssp" else ""
            self.write(f"parameter servers: {dims.ps_servers} rank(s) after the mesh hold the input embedding "
                       f"({rows:,} rows each) | ps_sync {p.ps_sync}{bound} | workers pull and push only the "
                       "rows their batch uses")
        self.write(f"tokens per step: {t.global_batch} sequences x {t.seq_len} = {t.global_batch * t.seq_len:,} | "
                   f"{t.steps} steps, {t.steps * t.global_batch * t.seq_len:,} tokens | lr {t.lr:g} "
                   f"({t.lr_schedule}, {t.warmup_steps} warmup)")
        self.write(f"output: {os.path.abspath(recipe.run.output_dir)}")
        self.write(f"start: resuming at step {start_step} of {t.steps}" if start_step else
                   f"start: fresh run from step 0 of {t.steps}")
        busiest = max(rank_memory(recipe, dims.world_size, staged_collectives=dims.device.type == "cpu",
                                  device_type=dims.device.type),
                      key=lambda r: r.total)
        self.write(f"memory: predicted peak {busiest.total / 2**30:.2f} GiB per rank (pp rank {busiest.pp_rank}: "
                   f"parameters {busiest.params / 2**30:.2f}, gradients {busiest.grads / 2**30:.2f}, optimizer "
                   f"{busiest.optim / 2**30:.2f}, activations {busiest.activations / 2**30:.2f} GiB; pipetrain.plan)")

    def save_checkpoint(self, checkpointer, trainer) -> str:
        """checkpointer.save(trainer) on every rank, timed; rank 0 prints the path, size and seconds."""
        t0 = time.perf_counter()
        path = checkpointer.save(trainer)
        seconds = time.perf_counter() - t0
        if self.enabled and getattr(checkpointer, "in_flight", False):
            self.write(f"checkpoint at step {trainer.step}: {path} (snapshot taken in {seconds:.1f} s, "
                       "writing in the background)")
        elif self.enabled:
            size = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)
            self.write(f"checkpoint at step {trainer.step}: {path} ({size / 1e6:.1f} MB, {seconds:.1f} s)")
        return path

    def summary(self) -> None:
        """Tokens, wall time and wall-clock tokens/s, steady-state tokens/s, final train and eval loss."""
        if not self.enabled or self.last_step is None:
            return
        wall = time.perf_counter() - self.started
        steps = self.last_step["step"] - self.start_step
        tokens = steps * self.tokens_per_step
        steady = steady_tokens_per_sec(self.step_rates)
        first = self.start_step + WARMUP_STEPS + 1
        steady_text = (f"steady state {steady:,.0f} tok/s (median of steps {first}-{self.last_step['step']})"
                       if steady is not None else f"steady state n/a (no step after the first {WARMUP_STEPS})")
        line = (f"done: {steps} steps ({self.start_step + 1}-{self.last_step['step']}), {tokens:,} tokens in "
                f"{format_duration(wall)} ({tokens / max(wall, 1e-9):,.0f} tok/s wall clock), {steady_text}, "
                f"final loss {self.last_step['loss']:.4f}")
        if self.last_eval is not None:
            line += (f", eval loss {self.last_eval['eval_loss']:.4f} (perplexity "
                     f"{_perplexity(self.last_eval['eval_loss']):.2f}) at step {self.last_eval['step']}")
        self.write(line)

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []
        if self.file is not None:
            self.file.close()
            self.file = None


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else float("inf")  # exp overflows a float past ~709
