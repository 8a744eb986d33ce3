"""The recipe's schema: one frozen dataclass per YAML section, ConfigError, and the helpers every
section's users share (clip for error lines, the LoRA projection names).

A recipe is data only. A new key is one field here, with its default and a comment saying what it does;
pipetrain.config.loading reads it from YAML and --set by its type hint, pipetrain.config.validation (or,
for parallel keys, pipetrain.parallel.mesh.rules) checks its value.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional


class ConfigError(ValueError):
    """A user error in a recipe, CLI flag or layout; the CLI prints it as one line and exits 2. One line
    whatever it quotes: a newline in its text (a file name may hold one) reads as \\n."""

    def __str__(self) -> str:
        return super().__str__().replace("\r", "\\r").replace("\n", "\\n")


MESSAGE_VALUE_CHARS = 200  # an offending value is quoted in an error line up to this many characters


def clip(text: str, limit: int = MESSAGE_VALUE_CHARS) -> str:
    """text cut to limit characters (with the count left off), so a huge value never floods an error line."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    family: Literal["llama", "qwen2", "mistral", "gpt2", "mixtral", "qwen3_moe"] = "llama"
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
    qk_norm: Optional[bool] = None        # RMSNorm over each q/k head before RoPE; None = family default (qwen3_moe)
    head_dim_: Optional[int] = None       # YAML key `head_dim`: attention head size; None = d_model / n_heads
    # ---- mixture of experts (pipetrain/models/moe.py, docs/models.md); names follow the HF configs ----
    num_experts: int = 0                  # routed experts per layer; 0 = dense MLP
    num_experts_per_tok: int = 2          # top-k experts each token goes to
    moe_intermediate_size: Optional[int] = None  # each expert's ffn; None = ffn_hidden's value
    shared_expert_intermediate_size: int = 0     # an always-on dense MLP beside the experts; 0 = none
    norm_topk_prob: Optional[bool] = None  # renormalise the top-k weights to sum 1; None = family default
    router_aux_loss_coef: float = 0.0     # sequence-wise load-balancing loss weight; 0 = off
    router_bias_update_rate: float = 0.0  # DeepSeek-V3 aux-loss-free balancing bias step; 0 = off
    # LoRA (pipetrain/models/lora.py, tp layout in pipetrain/parallel/tensor/lora.py): None = off; else the adapter rank r, with base weights frozen
    lora_rank: Optional[int] = None
    lora_alpha: float = 16.0              # the adapter output is scaled by lora_alpha / lora_rank
    lora_dropout: float = 0.0             # dropout on the adapter input (training only)
    lora_targets: list = field(default_factory=list)  # of LORA_PROJECTIONS; [] = every one the family has

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.head_dim_ or self.d_model // self.n_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_ffn(self) -> int:
        return self.moe_intermediate_size or self.ffn

    @property
    def active_ffn(self) -> int:
        """The MLP width one token passes through: ffn, or k routed experts plus the shared expert."""
        if not self.is_moe:
            return self.ffn
        return self.num_experts_per_tok * self.expert_ffn + self.shared_expert_intermediate_size

    @property
    def has_qk_norm(self) -> bool:
        return self.family == "qwen3_moe" if self.qk_norm is None else self.qk_norm

    @property
    def norm_topk(self) -> bool:
        """Renormalise the top-k weights: Mixtral always does; Qwen3-MoE by config (default False in HF)."""
        return self.family == "mixtral" if self.norm_topk_prob is None else self.norm_topk_prob

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


def lora_projections(family: str, moe: bool = False) -> tuple[str, ...]:
    """The projections a family's LoRA can target; a mixture of experts (moe): attention only (its experts
    are stacked tensors, not linears)."""
    if moe:
        return LORA_PROJECTIONS[:4]
    return tuple(n for n in LORA_PROJECTIONS if not (family == "gpt2" and n == "gate"))


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    dp: Optional[int] = None         # data-parallel replicas; None = world_size / (tp * pp * cp)
    tp: int = 1                      # tensor-parallel ranks; divides n_heads, ffn and vocab
    pp: int = 1                      # pipeline stages; <= model.n_layers
    cp: int = 1                      # context parallelism: ranks sharing each sequence; train.seq_len % (2*cp) == 0
    ep: int = 1                      # expert parallelism, carved out of dp: ranks sharing one layer's experts
    microbatches: int = 1            # per optimizer step and dp rank; >= pp for 1f1b
    schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "zbv", "dualpipev"] = "1f1b"
    virtual_stages: int = 1          # model chunks per pp rank (interleaved-1f1b)
    stage_layers: Optional[list] = None  # explicit layers per stage; None = balanced by cost
    zero: int = 0                    # 0 | 1 (shard optimizer state) | 2 (also gradients) | 3 (also parameters)
    reshard_after_forward: bool = True  # zero 3: free a unit's gathered parameters after its forward
    recompute: Literal["none", "selective", "full"] = "none"
    recompute_layers: Optional[int] = None  # full recompute only for the first N layers of a stage
    sequence_parallel: bool = False
    split_backward: bool = False     # pp > 1: zero-bubble split, input grads sent first, W fills the waits
    auto: bool = False               # fill the parallel keys not given here at launch (pipetrain.plan)
    # ---- relaxed synchronisation across replicas (pipetrain.parallel.replicas.stale / .periodic, docs/relaxed_sync.md) ----
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
    # ---- hybrid parameter server for the input embedding (pipetrain.parallel.ps, docs/parameter_server.md) ----
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
    precision: Literal["fp32", "bf16", "fp8"] = "fp32"  # fp8: block linears in float8 (parallel/tensor/fp8.py)
    fp8_emulate: bool = False        # fp8 through the fp32 emulation even on CUDA (a GPU older than sm_89 needs it)
    fp8_recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"  # fp8 scales (fp8_rowwise.py)
    grad_accumulation_fusion: bool = True  # add weight grads into .grad in place (pipetrain.parallel.pipeline.weight_grads)
    grad_accumulation_fusion_min_numel: int = 1 << 20  # smallest weight fused; smaller ones cost more than they save
    lr_schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"  # after warmup (pipetrain.lr_schedule)
    decay_fraction: float = 0.2      # wsd: the last fraction of train.steps decays linearly to min_lr
    optimizer: Literal["adamw", "sgd"] = "adamw"  # sgd: momentum train.momentum, weight decay train.weight_decay
    momentum: float = 0.0            # sgd only
    compile: bool = False            # torch.compile each transformer block, fullgraph (pipetrain.models.compile)
    fused_loss: Literal["auto", True, False] = "auto"  # LM head fused into the loss; auto = where measured faster (fused_loss_on)


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
        for (section, key), name in KEY_ALIASES.items():
            out[section][key] = out[section].pop(name)
        return out


SECTIONS = {
    "model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig,
    "data": DataConfig, "checkpoint": CheckpointConfig, "run": RunConfig, "faults": FaultsConfig,
}
# Recipe keys that are Python keywords, and their dataclass fields.
KEY_ALIASES = {("checkpoint", "async"): "async_", ("model", "head_dim"): "head_dim_"}


# device type -> the smallest vocabulary per tp rank at which benchmarks/gpu.py measured the fused loss at least
# as fast as the unfused Trainer in training; "auto" turns it on from there (its gain grows with the vocabulary:
# the logits it never builds are tokens x vocab). CUDA: on an H200 (2026-11-28, chunks of 4096 rows) it ran at
# 1.004x at vocab 128,256, at 0.80x the peak memory (docs/benchmarks.md): one run, as fast within its noise
# (0.992x with chunks of 1024 before), so what it buys is the memory; at 8192 it was slower (0.985x, with chunks
# of 1024), and nothing between is measured. The CPU path saves memory, not time, so the CPU stays off.
FUSED_LOSS_FASTER_FROM_VOCAB: dict[str, int] = {"cuda": 128_256}


def fused_loss_on(recipe: Recipe, device_type: str) -> bool:
    """train.fused_loss resolved for a run on device_type ("cuda", "cpu"): true / false as set; "auto" fuses where
    it was measured faster (a device type and a vocabulary per tp rank of at least FUSED_LOSS_FASTER_FROM_VOCAB's).
    What the build runs and what plan.memory counts."""
    if recipe.train.fused_loss == "auto":
        smallest = FUSED_LOSS_FASTER_FROM_VOCAB.get(device_type)
        return smallest is not None and recipe.model.vocab_size // recipe.parallel.tp >= smallest
    return bool(recipe.train.fused_loss)


def fp8_weights_once_a_run(recipe: Recipe) -> bool:
    """Whether the fp8 weights are quantised once per executor run (fp8.Fp8WeightCache): train.precision=fp8 with
    several microbatches a step (each quantised every weight again), below ZeRO-3 (which gathers them quantised),
    with tensorwise scales (the holders keep one tensorwise quantisation of each weight; rowwise needs two)."""
    p = recipe.parallel
    return (recipe.train.precision == "fp8" and recipe.train.fp8_recipe == "tensorwise" and p.zero != 3
            and (p.microbatches > 1 or p.dynamic_batch))
