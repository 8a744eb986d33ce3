"""The tokenizer of a Hugging Face model folder, checked against the model it feeds.

May import: config, data. Never: models, parallel, trainer, build, cli.
"""
from __future__ import annotations

from pipetrain.config import ConfigError, ModelConfig
from pipetrain.data import load_tokenizer


def check_tokenizer_vocab(tokenizer, cfg: ModelConfig, where: str = "data.tokenizer") -> None:
    """ConfigError when the tokenizer can emit ids the model has no embedding row for."""
    if len(tokenizer) > cfg.vocab_size:
        raise ConfigError(f"{where}: the tokenizer has {len(tokenizer)} tokens, more than the model's "
                          f"vocab_size={cfg.vocab_size}, got ids up to {len(tokenizer) - 1}; use the tokenizer "
                          "saved with the model (data.tokenizer empty reads it from model.init_from)")


def load_hf_tokenizer(path: str, cfg: ModelConfig):
    """The tokenizer at path (usually model.init_from), checked against cfg.vocab_size."""
    tokenizer = load_tokenizer(path)
    check_tokenizer_vocab(tokenizer, cfg)
    return tokenizer
