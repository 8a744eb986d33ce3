"""python -m pipetrain.generate CKPT_OR_HF_DIR --prompt "..." [--max-new-tokens N --temperature T
--top-p P --top-k K --seed S --tokenizer DIR --device cpu]: prints the prompt and its continuation."""
from __future__ import annotations

import argparse
import sys

import torch

from pipetrain.config import ArgumentParser, ConfigError
from pipetrain.generate import generate_tokens, load_for_generation


def parse_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m pipetrain.generate",
                            description="Continue a prompt with a pipetrain checkpoint or a Hugging Face model.")
    parser.add_argument("path", help="a checkpoints/step-... folder, a run folder (its newest checkpoint) "
                                     "or a Hugging Face model folder")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 keeps every token)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's own)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    return parser.parse_args(argv)


def _text(prompt: str) -> str:
    """The prompt as valid UTF-8 text: bytes that are not UTF-8 reach argv as surrogate escapes."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError("generate: --prompt is not valid UTF-8 text, got undecodable bytes; pass the prompt "
                          "in UTF-8") from None
    return prompt


def _device(name: str) -> torch.device:
    """--device as a device this machine has (ConfigError otherwise, not torch's traceback)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"generate: --device {name!r} is not a device name; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"generate: --device {name}: no CUDA device is available here; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"generate: --device {name}: this machine has {torch.cuda.device_count()} CUDA "
                          "device(s); use cuda:0 up to the last one")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"generate: --device {name}: only cpu and cuda are supported; use one of them")
    return device


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if not 0 <= args.seed < 2 ** 63:
            raise ConfigError(f"generate: --seed must be in [0, 2**63), got {args.seed}")
        model, tokenizer = load_for_generation(args.path, args.tokenizer, _device(args.device))
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        prompt = tokenizer(_text(args.prompt))["input_ids"] or [start]  # an empty prompt starts a document
        new = generate_tokens(model, prompt, args.max_new_tokens, args.temperature, args.top_p, args.top_k,
                              args.seed, eos_id=tokenizer.eos_token_id)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(tokenizer.decode(prompt + new, skip_special_tokens=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
