"""Data: prepare raw files once into memory-mapped token files, pack them into windows, serve batches.

- corpus.py: `prepare` (tokenise with datasets into a prepared directory) and `open_prepared` (memory maps).
- order.py: the O(1) seeded window order and the blend pattern.
- loader.py: windows split by documents into train/validation, Batch, Loader.

`build_loader(recipe, dims, tokenizer)` is what a run calls. A launch whose data is not prepared yet
prepares it first: local rank 0 of every node tokenises with a progress bar (into the shared cache, so
nodes on one shared disk race harmlessly: the first complete rename wins) while the node's other ranks
poll the file system for the manifest. No collective is involved, so a long prepare cannot hit the
process-group timeout; if the preparing rank fails, the launcher stops the others. Preparing ahead with
`python -m pipetrain.data prepare --recipe R` makes the launch start at once. Every rank then opens the
same files as read-only memory maps: per-rank memory does not grow with the corpus, and the ranks of a
node share the page cache.
"""
from __future__ import annotations

import os
import time

import numpy as np

from pipetrain.config import DataConfig
from pipetrain.data.corpus import (Corpus, is_prepared, load_tokenizer, open_prepared, prepare, prepared_dir_for,
                                   tokenizer_fingerprint)
from pipetrain.data.loader import IGNORE_INDEX, Batch, BlendedData, Loader, PackedData

POLL_SECONDS = 2.0


def sources_of(cfg: DataConfig) -> list[tuple[str, str, float]]:
    """(where, path, weight) of every source: data.sources, or data.path alone with weight 1."""
    if cfg.sources:
        return [(f"data.sources[{i}]", s["path"], float(s.get("weight", 1.0))) for i, s in enumerate(cfg.sources)]
    return [("data.path", cfg.path, 1.0)]


def prepare_sources(cfg: DataConfig, tokenizer, progress: bool = True) -> list[str]:
    """Prepare every source that is not prepared yet; the prepared directories, in source order."""
    return [prepare(path, tokenizer, text_field=cfg.text_field, cache_dir=cfg.cache_dir, num_proc=cfg.num_proc,
                    progress=progress, where=where) for where, path, _ in sources_of(cfg)]


def _wait_for(path: str) -> None:
    while not is_prepared(path):  # the node's local rank 0 is preparing it
        time.sleep(POLL_SECONDS)


def build_data(cfg: DataConfig, tokenizer, seq_len: int, *, prepare_missing: bool = True,
               log: bool = False) -> PackedData | BlendedData:
    """The windows of data.path (or the blend of data.sources), preparing what is missing or waiting for it."""
    parts, weights = [], []
    for d, (where, path, weight) in enumerate(sources_of(cfg)):
        out = prepared_dir_for(path, cfg.text_field, tokenizer, cfg.cache_dir)
        if not is_prepared(out):
            if prepare_missing:
                prepare(path, tokenizer, text_field=cfg.text_field, cache_dir=cfg.cache_dir, num_proc=cfg.num_proc,
                        progress=True, out_dir=out, where=where)
            else:
                _wait_for(out)
        corpus = open_prepared(out, tokenizer, verify=cfg.verify and prepare_missing, sources=out != path)
        seed = cfg.seed if d == 0 else cfg.seed + 1_000_003 * d  # sources hold out different documents
        parts.append(PackedData(corpus.tokens, corpus.mask, seq_len, cfg.val_fraction, seed, corpus.documents,
                                cfg.document_mask, name=where, tokenizer=corpus.manifest["tokenizer"]["fingerprint"],
                                vocab=len(tokenizer), path=out))
        weights.append(weight)
        if log:
            m = corpus.manifest
            print(f"data: {where} {out}: {m['num_tokens']:,} tokens, {m['num_documents']:,} documents, "
                  f"{parts[-1].num_train_windows:,} train / {parts[-1].num_val_windows:,} validation windows "
                  f"(validation: {parts[-1].val_split})", flush=True)
    if not cfg.sources:
        return parts[0]
    data = BlendedData(parts, weights)
    if log:
        shares = data.pattern.count / data.pattern.count.sum()
        for (where, path, _), share, part in zip(sources_of(cfg), shares, parts):
            print(f"data: blend {where} {path}: {share:.1%} of samples "
                  f"({part.num_train_windows:,} train windows)", flush=True)
    return data


def build_loader(recipe, dims, tokenizer) -> Loader:
    """The data of a run for this dp rank: prepare-or-open the corpus, split, order, Loader."""
    prepare_missing = int(os.environ.get("LOCAL_RANK", 0)) == 0
    data = build_data(recipe.data, tokenizer, recipe.train.seq_len, prepare_missing=prepare_missing,
                      log=dims.rank == 0)
    return Loader(data, recipe.train.global_batch, dims.dp_rank, dims.dp)


def tokenize_corpus(cfg: DataConfig, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """data.path's whole corpus in memory as (tokens, mask bool), prepared first when needed (tests, tools)."""
    corpus = open_prepared(prepare(cfg.path, tokenizer, text_field=cfg.text_field, cache_dir=cfg.cache_dir,
                                   num_proc=cfg.num_proc, progress=False), tokenizer)
    mask = np.ones(len(corpus.tokens), dtype=bool) if corpus.mask is None else np.asarray(corpus.mask, dtype=bool)
    return np.asarray(corpus.tokens), mask


__all__ = ["IGNORE_INDEX", "Batch", "BlendedData", "Corpus", "Loader", "PackedData", "build_data", "build_loader",
           "is_prepared", "load_tokenizer", "open_prepared", "prepare", "prepare_sources", "prepared_dir_for",
           "sources_of", "tokenize_corpus", "tokenizer_fingerprint"]
