"""Text generation: `python -m pipetrain.generate CKPT_OR_HF_DIR --prompt "..."` and the sample
printed at the end of a training run.

decode.py holds the KV-cached forward and the sampler (greedy at temperature 0, else top-k/top-p);
load.py builds the whole model from a checkpoint of any layout or a Hugging Face folder.
"""
from __future__ import annotations

from pipetrain.config import Recipe
from pipetrain.generate.decode import KVCache, choose_token, forward_cached, generate_tokens
from pipetrain.generate.load import latest_checkpoint, load_for_generation, model_from_checkpoint

SAMPLE_TEMPERATURE, SAMPLE_TOP_K = 0.8, 40  # the end-of-run sample: varied but not noise


def sample_text(model, tokenizer, num_tokens: int, seed: int = 0) -> str:
    """Text the model writes after a document boundary (EOS), until EOS or num_tokens."""
    ids = generate_tokens(model, [tokenizer.eos_token_id], num_tokens, SAMPLE_TEMPERATURE, top_k=SAMPLE_TOP_K,
                          seed=seed, eos_id=tokenizer.eos_token_id)
    return tokenizer.decode(ids, skip_special_tokens=True)


def end_of_run_sample(model, tokenizer, recipe: Recipe, dims, step: int) -> str:
    """The sample printed by global rank 0 after training. One process samples the model in memory;
    a multi-process run holds only shards on each rank, so rank 0 reads the full weights back from
    the final checkpoint (every rank's files, gathered on disk) instead."""
    if dims.world_size == 1:
        text = sample_text(model, tokenizer, recipe.run.sample_tokens, seed=recipe.train.seed)
        return f"\n--- sample after {step} steps ---\n{text}\n---"
    ckpt = latest_checkpoint(recipe.run.output_dir)
    if ckpt is None:
        return ("no sample: a multi-process run samples from its final checkpoint and none was written "
                f"under {recipe.run.output_dir}/checkpoints")
    full, _ = model_from_checkpoint(ckpt, dims.device)
    text = sample_text(full, tokenizer, recipe.run.sample_tokens, seed=recipe.train.seed)
    return f"\n--- sample after {step} steps (from {ckpt}) ---\n{text}\n---"


__all__ = ["KVCache", "choose_token", "end_of_run_sample", "forward_cached", "generate_tokens", "latest_checkpoint",
           "load_for_generation", "model_from_checkpoint", "sample_text"]
