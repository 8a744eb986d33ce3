"""One decoder-only transformer that covers the llama, qwen2, mistral and gpt2 families by config, and the
mixture-of-experts families mixtral (llama attention) and qwen3_moe (q/k RMSNorm per head) whose blocks
hold a pipetrain.models.moe.MoE in place of the MLP.

The model is blind to parallelism: tensor parallelism swaps its Linear/Embedding modules from outside,
pipeline parallelism deletes layers (kept in a ModuleDict so global names survive) and sets embed,
norm or head to None, which forward() skips. Head counts are read from tensor shapes, so a layer
holding a shard of the heads needs no change here.

Document masking: forward(x, positions) with positions (B, T), each token's position inside its own
document (0 at every document start), makes attention block-causal (a token sees only earlier tokens of
its document; a document starts wherever positions is 0) and indexes RoPE / learned positions by them.
positions=None is plain causal attention over 0..T-1.

Shapes: B batch, T time, D model, H heads (Hq query, Hkv key/value), K head dim, F ffn, V vocab.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipetrain.config import ModelConfig
from pipetrain.kernels import rms_norm, rope, swiglu
from pipetrain.kernels.dispatch import autocast_dtype
from pipetrain.models.moe import MoE


def norm_output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a norm returns: autocast's where autocast is on, else x's.

    Under bf16 autocast the residual stream x is fp32, and every consumer of a norm is a linear that
    autocast runs in bf16 (a MoE's router and experts too; its combine stays fp32, models/moe.py). A norm
    that returned fp32 left each of them to cast it: q, k and v three bf16 copies of one tensor (each saved
    for backward), gate and up two, with a cast back to fp32 and an fp32 sum of their gradients in the
    backward. The norm writes bf16 once instead, as Megatron-LM's and torchtitan's do; their input
    gradients then sum in bf16, as theirs do. fp32 runs are unchanged."""
    return autocast_dtype(x) or x.dtype


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps, norm_output_dtype(x))


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm computed in fp32, returned in norm_output_dtype."""

    def forward(self, x):
        return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(),
                            self.eps).to(norm_output_dtype(x))


def build_norm(cfg: ModelConfig) -> nn.Module:
    return LayerNorm(cfg.d_model, eps=cfg.norm_eps) if cfg.family == "gpt2" else RMSNorm(cfg.d_model, cfg.norm_eps)


def rope_tables(seq_len: int, head_dim: int, theta: float, device, dtype):
    """cos, sin of shape (T, K), halves duplicated as Hugging Face's rotary embedding lays them out."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # (T, K/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(K)) v, causal (optionally within a sliding window). No parameters, so
    selective recomputation can wrap exactly this module."""

    def __init__(self, sliding_window: int | None):
        super().__init__()
        self.sliding_window = sliding_window

    def forward(self, q, k, v, positions=None):  # q (B, T, Hq, K), k/v (B, T, Hkv, K) -> (B, T, Hq*K)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        T = q.shape[2]
        gqa = q.shape[1] != k.shape[1]
        if positions is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(positions, self.sliding_window),
                                                 enable_gqa=gqa)
        elif self.sliding_window and self.sliding_window < T:
            i = torch.arange(T, device=q.device)
            mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.sliding_window)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return out.transpose(1, 2).flatten(2)


def linears_of_one_input(x: torch.Tensor, linears: tuple[nn.Module, ...], shared=None) -> tuple[torch.Tensor, ...]:
    """Each of linears applied to the same x. shared(x, linears), where set, computes them together: under
    train.precision=fp8 it quantises x once for all of them (pipetrain.parallel.tensor.fp8.fp8_linears) where
    one call per linear would quantise, and save for backward, a float8 copy of x each."""
    if shared is not None:
        return shared(x, linears)
    return tuple(linear(x) for linear in linears)


def document_mask(positions: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """(B, 1, T, T) bool, True where query i may attend key j: j <= i, same document, inside the window."""
    doc = torch.cumsum(positions == 0, dim=1)  # (B, T) document number inside the window
    i = torch.arange(positions.shape[1], device=positions.device)
    allowed = (i[None, :] <= i[:, None])[None] & (doc[:, :, None] == doc[:, None, :])
    if sliding_window:
        allowed = allowed & (i[:, None] - i[None, :] < sliding_window)[None]
    return allowed[:, None]


class Attention(nn.Module):
    ONE_INPUT_LINEARS = ("wq", "wk", "wv")  # the linears of x, for a shared_input callable

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        K, D = cfg.head_dim, cfg.d_model
        self.head_dim = K
        self.use_rope = cfg.family != "gpt2"
        self.rope_theta = cfg.rope_theta
        self.wq = nn.Linear(D, cfg.n_heads * K, bias=cfg.has_qkv_bias or cfg.family == "gpt2")
        self.wk = nn.Linear(D, cfg.kv_heads * K, bias=cfg.has_qkv_bias or cfg.family == "gpt2")
        self.wv = nn.Linear(D, cfg.kv_heads * K, bias=cfg.has_qkv_bias or cfg.family == "gpt2")
        self.wo = nn.Linear(cfg.n_heads * K, D, bias=cfg.family == "gpt2")
        self.core = AttentionCore(cfg.sliding_window)
        # qwen3: RMSNorm over each head's K channels of q and k, before RoPE (one (K,) weight shared by heads)
        self.q_norm = RMSNorm(K, cfg.norm_eps) if cfg.has_qk_norm else None
        self.k_norm = RMSNorm(K, cfg.norm_eps) if cfg.has_qk_norm else None
        # RoPE table length when positions index past this input's T (a context-parallel slice holds global
        # positions; pipetrain.parallel.context sets the full sequence length). None: the input's T.
        self.rope_len: int | None = None
        self.shared_input = None  # linears_of_one_input's callable for wq, wk, wv (set by train.precision=fp8)

    def forward(self, x, positions=None):  # x (B, T, D) or (B, T/tp, D) under sequence parallelism
        # (B, T, Hq/tp * K) and (B, T, Hkv/tp * K): read T and heads from the outputs, not the input
        q, k, v = linears_of_one_input(x, (self.wq, self.wk, self.wv), self.shared_input)
        q, k, v = (t.view(*t.shape[:2], -1, self.head_dim) for t in (q, k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope and positions is None:
            cos, sin = rope_tables(q.shape[1], self.head_dim, self.rope_theta, q.device, q.dtype)
            q, k = rope(q, k, cos, sin)
        elif self.use_rope:  # per-sequence positions: rotate the (B*T) tokens as one sequence of gathered rows
            B, T = positions.shape
            cos, sin = rope_tables(self.rope_len or T, self.head_dim, self.rope_theta, q.device, q.dtype)
            flat = positions.to(q.device).reshape(-1)
            q, k = rope(q.reshape(1, B * T, *q.shape[2:]), k.reshape(1, B * T, *k.shape[2:]), cos[flat], sin[flat])
            q, k = q.view(B, T, *q.shape[2:]), k.view(B, T, *k.shape[2:])
        if positions is None:
            return self.wo(self.core(q, k, v))
        return self.wo(self.core(q, k, v, positions.to(q.device)))


class MLP(nn.Module):
    ONE_INPUT_LINEARS = ("gate", "up")  # gated: the linears of x, for a shared_input callable

    def __init__(self, cfg: ModelConfig, ffn: int | None = None):
        super().__init__()
        D, Fh = cfg.d_model, ffn or cfg.ffn
        self.gated = cfg.family != "gpt2"
        bias = cfg.family == "gpt2"
        if self.gated:
            self.gate = nn.Linear(D, Fh, bias=False)
        self.up = nn.Linear(D, Fh, bias=bias)
        self.down = nn.Linear(Fh, D, bias=bias)
        self.shared_input = None  # linears_of_one_input's callable for gate, up (set by train.precision=fp8)

    def forward(self, x):
        if self.gated:
            gate, up = linears_of_one_input(x, (self.gate, self.up), self.shared_input)
            return self.down(swiglu(gate, up))  # (B, T, F/tp) inside
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = build_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = build_norm(cfg)
        if cfg.is_moe:
            shared = cfg.shared_expert_intermediate_size
            self.mlp = MoE(cfg, MLP(cfg, shared) if shared else None)
        else:
            self.mlp = MLP(cfg)

    def forward(self, x, positions=None):
        h = x + (self.attn(self.attn_norm(x)) if positions is None else self.attn(self.attn_norm(x), positions))
        return h + self.mlp(self.mlp_norm(h))


class PositionEmbedding(nn.Embedding):
    """Learned absolute positions (gpt2). forward(T) returns the (T, D) table rows for 0..T-1;
    forward(T, positions) the (B, T, D) rows of the given positions (document masking)."""

    def forward(self, seq_len: int, positions: torch.Tensor | None = None):
        if positions is not None:
            return super().forward(positions.to(self.weight.device))
        return super().forward(torch.arange(seq_len, device=self.weight.device))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embed = PositionEmbedding(cfg.max_seq_len, cfg.d_model) if cfg.family == "gpt2" else None
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = build_norm(cfg)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tied:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, V); a pipeline stage without embed takes and/or returns (B, T, D).
        positions (B, T) of every token in its document, or None: see the module docstring."""
        if self.embed is not None:
            h = self.embed(x)  # (B, T, D), or (B, T/tp, D) under sequence parallelism
            if self.pos_embed is not None:
                h = h + (self.pos_embed(x.shape[1]) if positions is None else self.pos_embed(x.shape[1], positions))
        else:
            h = x
        for layer in self.layers.values():
            h = layer(h) if positions is None else layer(h, positions)
        if self.norm is not None:
            h = self.norm(h)
        if self.head is not None:
            h = self.head(h)  # (B, T, V/tp)
        return h


def count_params(model: nn.Module, exclude_embeddings: bool = False, active: bool = False) -> int:
    """Parameters of model (all of them; active: those one token uses, i.e. k of the E routed experts)."""
    total = 0
    for name, p in model.named_parameters():
        if exclude_embeddings and name.split(".")[0] in ("embed", "pos_embed"):
            continue
        n = p.numel()
        if active and ".experts." in name:
            cfg = model.cfg
            n = n * cfg.num_experts_per_tok // cfg.num_experts
        total += n
    return total


def mlp_matmul_params(cfg: ModelConfig) -> int:
    """Weights one token multiplies by in one block's MLP: the dense SwiGLU/GELU MLP, or the router, its
    k routed experts and the shared expert (what flops and the planner's active compute use)."""
    if not cfg.is_moe:
        return cfg.d_model * cfg.ffn * (3 if cfg.family != "gpt2" else 2)
    return cfg.d_model * cfg.num_experts + 3 * cfg.d_model * cfg.active_ffn


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training matmul FLOPs per token (forward + backward = 3x forward), see docs/mfu.md.

    Counts every matmul once with 2 FLOPs per multiply-add: q/k/v/o projections (GQA-aware), the
    MLP (3 matrices for SwiGLU, 2 for GELU; an MoE's router and active experts), the LM head, and attention
    scores and values with the causal mask halving the useful work (T/2 keys per query on average). Norms,
    activations and softmax are left out, as in Megatron-LM and PaLM; recomputation is not counted (that is
    HFU).
    """
    D, K, L = cfg.d_model, cfg.head_dim, cfg.n_layers
    Hq, Hkv = cfg.n_heads, cfg.kv_heads
    proj = 2 * D * K * (2 * Hq + 2 * Hkv)
    mlp = 2 * mlp_matmul_params(cfg)  # a mixture of experts: active experts only
    window = min(seq_len, cfg.sliding_window or seq_len)
    attn = 2 * 2 * Hq * K * (window / 2 if window == seq_len else window)
    head = 2 * D * cfg.vocab_size
    return 3.0 * (L * (proj + mlp + attn) + head)


__all__ = ["Decoder", "Block", "Attention", "MLP", "RMSNorm", "LayerNorm", "count_params", "document_mask",
           "flops_per_token", "mlp_matmul_params", "rope_tables"]
