"""Sampling from a trained single-process model, so a user sees what it learned at the end of a run."""
from __future__ import annotations

import torch


@torch.no_grad()
def sample_tokens(model, prompt: list[int], num_tokens: int, max_seq_len: int, temperature: float = 0.8,
                  top_k: int = 40, seed: int = 0, device="cpu") -> list[int]:
    """Top-k sampling; the context is cropped to max_seq_len (no KV cache: the model is small)."""
    model.eval()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt)
    for _ in range(num_tokens):
        ctx = torch.tensor([ids[-max_seq_len:]], device=device)
        logits = model(ctx)[0, -1].float().cpu() / temperature
        top = torch.topk(logits, min(top_k, logits.numel()))
        probs = torch.softmax(top.values, dim=-1)
        ids.append(int(top.indices[torch.multinomial(probs, 1, generator=gen)]))
    return ids


def sample_text(model, tokenizer, num_tokens: int, seed: int = 0, device="cpu") -> str:
    prompt = [tokenizer.eos_token_id]  # a document boundary: the model starts a new document
    ids = sample_tokens(model, prompt, num_tokens, model.cfg.max_seq_len, seed=seed, device=device)
    return tokenizer.decode(ids[1:])
