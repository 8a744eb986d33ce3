"""Data: load documents with `datasets`, tokenise once (cached), pack into windows, serve batches.

Documents are tokenised, each followed by EOS, and concatenated into one stream; window i is
tokens[i*S : i*S + S + 1] (S = seq_len), so inputs are the first S tokens and targets the last S.
A loss mask travels with the stream (all ones for plain text; supervised fine-tuning data trains
only on completion tokens) and masked targets become IGNORE_INDEX.

Layout independence: windows are split into train/validation by a permutation from data.seed, and
each epoch visits the train windows in a permutation seeded by (data.seed, epoch). Global sample g
of the run is a pure function of g, so step k's global batch (samples k*GB .. k*GB+GB-1) is the
same sequences for every layout; dp rank r takes the contiguous slice r*GB/dp .. (r+1)*GB/dp - 1.
The loader position is one integer (samples consumed), so resume continues at the exact next sample.
Note: packed documents can attend to earlier documents in the same window (no cross-document mask),
as in GPT-2 / Megatron pre-training.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np
import torch

from pipetrain.config import ConfigError, DataConfig

IGNORE_INDEX = -100
CACHE_VERSION = 1
_EXTENSIONS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json",
               ".parquet": "parquet"}


def load_tokenizer(path: str):
    """A Hugging Face tokenizer from a local directory (or a hub name when online)."""
    from transformers import AutoTokenizer

    if not path:
        raise ConfigError("data.tokenizer is empty; set it to a tokenizer directory such as pipetrain/assets/tokenizer")
    if os.path.sep in path and not os.path.isdir(path):
        raise ConfigError(f"data.tokenizer: directory {path!r} not found; point it at a folder with tokenizer.json")
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"data.tokenizer: cannot load {path!r} ({first}); "
                          "use a local directory with tokenizer.json") from None
    if tok.eos_token_id is None:
        raise ConfigError(f"data.tokenizer: {path!r} has no EOS token; documents need one as separator")
    return tok


def _data_files(path: str) -> tuple[str, list[str]]:
    """(builder, files) for a local file or folder; ("", []) for a dataset name."""
    if os.path.isfile(path):
        files = [path]
    elif os.path.isdir(path):
        files = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                       if os.path.splitext(f)[1] in _EXTENSIONS)
        if not files:
            raise ConfigError(f"data.path: folder {path!r} has no .txt, .jsonl or .parquet files")
    elif os.path.isabs(path) or path.startswith("."):
        raise ConfigError(f"data.path: {path!r} not found; point it at a text/jsonl/parquet file or folder")
    else:
        return "", []
    kinds = {_EXTENSIONS.get(os.path.splitext(f)[1]) for f in files}
    if None in kinds or len(kinds) != 1:
        raise ConfigError(f"data.path: {path!r} must hold files of one kind (.txt, .jsonl or .parquet), "
                          f"got extensions {sorted({os.path.splitext(f)[1] for f in files})}")
    return kinds.pop(), files


def _fingerprint(cfg: DataConfig, files: list[str], tokenizer) -> str:
    h = hashlib.sha256(f"v{CACHE_VERSION}|{cfg.path}|{cfg.text_field}".encode())
    for f in files:
        st = os.stat(f)
        h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}".encode())
    h.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    h.update(str(tokenizer.eos_token_id).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())  # chat data renders through it
    return h.hexdigest()[:20]


def _load_dataset(cfg: DataConfig, builder: str, files: list[str], cache_dir: str):
    """The documents as a datasets.Dataset (local files through the generic builders)."""
    import datasets

    datasets.disable_progress_bars()
    if builder == "text":
        ds = datasets.load_dataset("text", data_files=files, sample_by="document", split="train",
                                   cache_dir=os.path.join(cache_dir, "datasets"))
    elif builder:
        ds = datasets.load_dataset(builder, data_files=files, split="train",
                                   cache_dir=os.path.join(cache_dir, "datasets"))
    else:
        ds = datasets.load_dataset(cfg.path, split="train")
    return ds


def _encode(ds, cfg: DataConfig, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Token stream and loss mask for a dataset of plain text, prompt/completion or chat records."""
    from pipetrain.sft import encode_record  # fine-tuning formats live beside the chat-template logic

    eos = tokenizer.eos_token_id
    columns = set(ds.column_names)
    tokens, masks = [], []
    if cfg.text_field in columns and not ({"prompt", "completion"} <= columns or "messages" in columns):
        for start in range(0, len(ds), 1000):
            texts = ds[start:start + 1000][cfg.text_field]
            for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
                tokens.append(np.asarray(ids + [eos], dtype=np.int64))
                masks.append(np.ones(len(ids) + 1, dtype=bool))
    elif {"prompt", "completion"} <= columns or "messages" in columns:
        for record in ds:
            ids, mask = encode_record(record, tokenizer)
            tokens.append(np.asarray(ids, dtype=np.int64))
            masks.append(np.asarray(mask, dtype=bool))
    else:
        raise ConfigError(f"data.text_field={cfg.text_field!r} is not a column of {cfg.path!r} "
                          f"(columns: {sorted(columns)}); set data.text_field or use prompt/completion or messages")
    if not tokens:
        raise ConfigError(f"data.path: {cfg.path!r} holds no documents")
    return np.concatenate(tokens), np.concatenate(masks)


def tokenize_corpus(cfg: DataConfig, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """The whole corpus as (tokens int32, mask bool), read from the cache when it is there."""
    cache_dir = os.path.expanduser(cfg.cache_dir or "~/.cache/pipetrain")
    builder, files = _data_files(cfg.path)
    key = _fingerprint(cfg, files, tokenizer)
    path = os.path.join(cache_dir, f"tokens-{key}.npz")
    if os.path.exists(path):
        with np.load(path) as z:
            return z["tokens"], z["mask"]
    ds = _load_dataset(cfg, builder, files, cache_dir)
    tokens, mask = _encode(ds, cfg, tokenizer)
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max else np.int32
    tokens = tokens.astype(dtype)
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp.npz"  # several ranks may race: write privately, rename atomically
    np.savez(tmp, tokens=tokens, mask=mask)
    os.replace(tmp, path)
    return tokens, mask


@dataclass
class Batch:
    inputs: torch.Tensor   # (b, S) int64
    targets: torch.Tensor  # (b, S) int64, IGNORE_INDEX where not trained

    def split(self, num: int) -> list["Batch"]:
        return [Batch(i, t) for i, t in zip(self.inputs.chunk(num), self.targets.chunk(num))]


class PackedData:
    """Fixed-length windows over the token stream with a deterministic, layout-independent order."""

    def __init__(self, tokens: np.ndarray, mask: np.ndarray, seq_len: int, val_fraction: float, seed: int):
        self.tokens, self.mask, self.seq_len, self.seed = tokens, mask, seq_len, seed
        self.all_trained = bool(mask.all())  # plain text: every target counts, no need to look
        num_windows = (len(tokens) - 1) // seq_len
        num_val = int(round(num_windows * val_fraction))
        if num_windows - num_val < 1:
            raise ConfigError(f"data: corpus of {len(tokens)} tokens gives {num_windows} windows of "
                              f"train.seq_len={seq_len}; use more data or a shorter seq_len")
        order = np.random.default_rng(seed).permutation(num_windows)
        self.val_ids = np.sort(order[:num_val])
        self.train_ids = np.sort(order[num_val:])

    def _window_batch(self, ids) -> Batch:
        S = self.seq_len
        idx = np.asarray(ids)[:, None] * S + np.arange(S + 1)[None, :]
        win = torch.from_numpy(self.tokens[idx].astype(np.int64))
        keep = torch.from_numpy(self.mask[idx][:, 1:])
        targets = win[:, 1:].masked_fill(~keep, IGNORE_INDEX)
        return Batch(win[:, :-1].contiguous(), targets.contiguous())

    def train_window(self, sample: int) -> int:
        n = len(self.train_ids)
        epoch, pos = divmod(sample, n)
        perm = np.random.default_rng([self.seed, epoch]).permutation(n)
        return int(self.train_ids[perm[pos]])

    def train_batch(self, first_sample: int, count: int) -> Batch:
        return self._window_batch([self.train_window(first_sample + i) for i in range(count)])

    def val_batch(self, first: int, count: int) -> Batch:
        ids = [self.val_ids[(first + i) % len(self.val_ids)] for i in range(count)]
        return self._window_batch(ids)


class Loader:
    """Serves each step's batch for one dp rank; its whole state is the number of samples consumed."""

    def __init__(self, data: PackedData, global_batch: int, dp_rank: int, dp_size: int):
        self.data, self.global_batch, self.dp_rank, self.dp_size = data, global_batch, dp_rank, dp_size
        self.samples = 0

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp_size

    def next(self) -> tuple[Batch, int]:
        """(this dp rank's slice of the next global batch, target tokens in the whole global batch)."""
        start = self.samples + self.dp_rank * self.local_batch
        batch = self.data.train_batch(start, self.local_batch)
        if self.data.all_trained:
            total = self.global_batch * self.data.seq_len
        else:  # masked fine-tuning data: count the trained targets of the whole global batch (cheap)
            total = int((self.data.train_batch(self.samples, self.global_batch).targets != IGNORE_INDEX).sum())
        self.samples += self.global_batch
        return batch, total

    def val_batches(self, num_batches: int):
        """The fixed validation set: num_batches global batches, this rank's slice of each."""
        if len(self.data.val_ids) == 0:
            return []
        out = []
        for b in range(num_batches):
            first = b * self.global_batch + self.dp_rank * self.local_batch
            out.append(self.data.val_batch(first, self.local_batch))
        return out

    def state_dict(self) -> dict:
        return {"samples": self.samples, "num_train_windows": len(self.data.train_ids), "seed": self.data.seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_train_windows") != len(self.data.train_ids) or state.get("seed") != self.data.seed:
            raise ConfigError(f"checkpoint data position was saved for {state.get('num_train_windows')} windows "
                              f"and data.seed={state.get('seed')}, but this data gives {len(self.data.train_ids)} "
                              f"and data.seed={self.data.seed}; resume with the same data, seq_len and seed")
        self.samples = int(state["samples"])
