"""Autoregressive decoding with a KV cache over the plain single-device Decoder.

The cache lives here, not in the model: forward_cached() runs the decoder's own modules (embedding,
each block's norms, q/k/v/o projections, rope kernel and MLP, the final norm and head) and keeps every
layer's rotated keys and values, so each new token costs one position of compute and models/ stays
blind to inference. tests/unit/test_generate.py checks its logits against Decoder.forward.

Shapes: B batch, T new positions, S cached + new positions, H heads, K head dim, D model, V vocab.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pipetrain.kernels import rope
from pipetrain.models.decoder import Attention, Decoder, rope_tables


class KVCache:
    """Keys and values per layer, (B, S, Hkv, K) each, after rotation; `length` positions so far."""

    def __init__(self):
        self.layers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.length = 0


def _attend(attn: Attention, x: torch.Tensor, cache: KVCache, name: str, window: int | None) -> torch.Tensor:
    pos = cache.length
    q = attn.wq(x)  # (B, T, Hq * K)
    q = q.view(*q.shape[:2], -1, attn.head_dim)
    k = attn.wk(x)
    k = k.view(*k.shape[:2], -1, attn.head_dim)
    v = attn.wv(x)
    v = v.view(*v.shape[:2], -1, attn.head_dim)
    T = q.shape[1]
    if attn.q_norm is not None:  # qwen3_moe: per-head q/k RMSNorm before RoPE, as Attention.forward
        q, k = attn.q_norm(q), attn.k_norm(k)
    if attn.use_rope:
        cos, sin = rope_tables(pos + T, attn.head_dim, attn.rope_theta, q.device, q.dtype)
        q, k = rope(q, k, cos[pos:].contiguous(), sin[pos:].contiguous())  # rotate at absolute positions
    if name in cache.layers:
        k_past, v_past = cache.layers[name]
        k, v = torch.cat([k_past, k], dim=1), torch.cat([v_past, v], dim=1)  # (B, S, Hkv, K)
    cache.layers[name] = (k, v)
    S = k.shape[1]
    i = torch.arange(pos, pos + T, device=q.device)[:, None]  # absolute query positions
    j = torch.arange(S, device=q.device)[None, :]
    mask = j <= i
    if window:
        mask &= (i - j) < window
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return attn.wo(out.transpose(1, 2).flatten(2))


@torch.no_grad()
def forward_cached(model: Decoder, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """tokens (B, T) at positions cache.length.. -> logits (B, T, V); appends their keys/values to cache."""
    pos, T = cache.length, ids.shape[1]
    if pos + T > model.cfg.max_seq_len:
        raise ValueError(f"generate: {pos + T} positions exceed model.max_seq_len={model.cfg.max_seq_len}; "
                         "shorten the prompt or --max-new-tokens")
    h = model.embed(ids)  # (B, T, D)
    if model.pos_embed is not None:
        h = h + model.pos_embed.weight[pos:pos + T]
    for name, block in model.layers.items():
        h = h + _attend(block.attn, block.attn_norm(h), cache, name, model.cfg.sliding_window)
        h = h + block.mlp(block.mlp_norm(h))
    cache.length += T
    return model.head(model.norm(h))


def choose_token(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
                 generator: torch.Generator | None = None) -> int:
    """Next token from (V,) logits: argmax at temperature 0, else sampled after top-k and top-p (nucleus)."""
    if not bool(torch.isfinite(logits).all()):  # finite weights past fp32's range: softmax of inf is NaN
        raise ValueError("generate: the model's next-token logits hold inf or NaN, got weights whose products "
                         "overflow fp32; the model is damaged: use an intact copy")
    if temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.double().cpu()
    logits = (logits - logits.max()) / temperature  # the max at 0 first: a tiny temperature overflowed to inf (NaN)
    if top_k and top_k < logits.numel():
        cutoff = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < cutoff, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs > top_p  # tokens after the nucleus already covers top_p
        logits = logits.index_fill(0, order[drop], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def check_sampling(max_new_tokens: int, temperature: float, top_p: float, top_k: int) -> None:
    problems = []
    if max_new_tokens < 0:
        problems.append(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    if not 0 <= temperature < float("inf"):  # also refuses nan, which every comparison fails
        problems.append(f"--temperature must be a finite number >= 0 (0 is greedy), got {temperature}")
    if not 0 < top_p <= 1:
        problems.append(f"--top-p must be in (0, 1], got {top_p}")
    if top_k < 0:
        problems.append(f"--top-k must be >= 0 (0 keeps every token), got {top_k}")
    if problems:
        raise ValueError("generate: " + "; ".join(problems))


@torch.no_grad()
def generate_tokens(model: Decoder, prompt: list[int], max_new_tokens: int, temperature: float = 0.0,
                    top_p: float = 1.0, top_k: int = 0, seed: int = 0, eos_id: int | None = None) -> list[int]:
    """New token ids after prompt (the EOS that stopped it included), at most max_new_tokens and never
    past model.max_seq_len. One forward over the prompt, then one position per token from the cache."""
    check_sampling(max_new_tokens, temperature, top_p, top_k)
    if not prompt:
        raise ValueError("generate: the prompt is empty, got 0 tokens; pass at least one token")
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    budget = min(max_new_tokens, model.cfg.max_seq_len - len(prompt))
    cache = KVCache()
    logits = forward_cached(model, torch.tensor([prompt], device=device), cache)[0, -1]
    out: list[int] = []
    while len(out) < budget:
        token = choose_token(logits, temperature, top_p, top_k, generator)
        out.append(token)
        if token == eos_id or len(out) == budget:
            break
        logits = forward_cached(model, torch.tensor([[token]], device=device), cache)[0, -1]
    return out

