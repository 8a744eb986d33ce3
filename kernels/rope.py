"""Rotary position embedding, Hugging Face "rotate_half" convention.
Shapes: q (B, T, Hq, K), k (B, T, Hkv, K), cos/sin (T, K) with the two halves duplicated."""
import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_ref(q, k, cos, sin):
    cos = cos[:, None, :]  # (T, 1, K) broadcasts over heads
    sin = sin[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def rope(q, k, cos, sin):
    return rope_ref(q, k, cos, sin)
