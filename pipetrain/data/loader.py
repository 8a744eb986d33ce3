"""Packed windows over (memory-mapped) token streams, their order, and the per-dp-rank loader.

Documents (each closed by EOS) are split into train and validation by document: round(num_documents *
val_fraction) documents, at most all but one, are held out, chosen by data.seed. When that rounds to none
(a corpus of one text file, or a few long documents: whole documents cannot give val_fraction), the last
val_fraction of every document's tokens (rounded up) is held out instead, as nanoGPT holds out the end of
its one stream; `val_split` says which split was taken (the data line prints it). The train stream is the
train documents (or parts) concatenated in corpus order (a virtual stream over the memory map: runs of
consecutive train tokens, no copy); the validation stream likewise. Window i of a stream is
stream[i*S : i*S + S + 1] (S = seq_len): inputs are its first S tokens, targets its last S. A stream
without a document index (an in-memory array) counts every block of S tokens as a document. A loss mask
travels with the tokens (fine-tuning data trains only on completion tokens); masked targets become
IGNORE_INDEX.

Order (see order.py): train sample g is window WindowOrder(n, seed)(g // n, g % n) of the n train
windows, O(1) per sample and the same for every layout. Step k's global batch is samples k*GB ..
k*GB+GB-1; dp rank r takes the contiguous slice r*GB/dp .. (r+1)*GB/dp - 1. The loader position is one
integer (samples consumed), so a resumed run continues at the exact next sample. Blends (data.sources)
draw sample g from source BlendPattern(weights)(g), each source with its own order and epochs.

With document_mask, each Batch carries positions (B, S): the position of every input token inside its
own document, restarting at 0 at each document start and at the window start. The model derives
block-causal attention from them (a token attends only to earlier tokens of its own document).
Without it, packed documents attend to earlier documents of the window, as in GPT-2 / Megatron.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from pipetrain.config import ConfigError
from pipetrain.data.order import BlendPattern, WindowOrder

IGNORE_INDEX = -100


@dataclass
class Batch:
    inputs: torch.Tensor                       # (b, S) int64
    targets: torch.Tensor                      # (b, S) int64, IGNORE_INDEX where not trained
    positions: Optional[torch.Tensor] = None   # (b, S) int64 position in document; None = 0..S-1, one causal block

    def split(self, num: int) -> list["Batch"]:
        pos = self.positions.chunk(num) if self.positions is not None else [None] * num
        return [Batch(i, t, p) for i, t, p in zip(self.inputs.chunk(num), self.targets.chunk(num), pos)]


class _Stream:
    """A virtual concatenation of runs [start, start+length) of the physical token array."""

    def __init__(self, starts: np.ndarray, lengths: np.ndarray):
        keep = lengths > 0
        self.starts, self.lengths = starts[keep].astype(np.int64), lengths[keep].astype(np.int64)
        self.vstarts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
        self.length = int(self.lengths.sum())

    def physical(self, virtual: np.ndarray) -> np.ndarray:
        if len(self.starts) == 1:
            return virtual + self.starts[0]
        run = np.searchsorted(self.vstarts, virtual, side="right") - 1
        return self.starts[run] + (virtual - self.vstarts[run])


def _plain(array: np.ndarray) -> np.ndarray:
    """A memmap as a plain ndarray over the same pages: no np.memmap Python overhead per index."""
    return array.view(np.ndarray) if isinstance(array, np.memmap) else array


class PackedData:
    """Fixed-length windows over one token stream, split by documents, in an O(1) layout-independent order."""

    def __init__(self, tokens: np.ndarray, mask: Optional[np.ndarray], seq_len: int, val_fraction: float, seed: int,
                 documents: Optional[np.ndarray] = None, document_mask: bool = False, name: str = "data",
                 tokenizer: Optional[str] = None, vocab: Optional[int] = None, path: str = ""):
        """tokenizer: the fingerprint of the tokenizer the tokens came from (a resume checks it), when known;
        vocab: the tokenizer's size, when known: a window holding an id past it is refused (_checked), and path
        the prepared folder the tokens came from, for that error."""
        self.tokens, self.seq_len, self.seed, self.name = _plain(tokens), seq_len, seed, name
        self.tokenizer, self.vocab, self.path = tokenizer, vocab, path
        self.mask = None if mask is None or (mask.dtype == bool and mask.all()) else _plain(mask)
        self.all_trained = self.mask is None  # plain text: every target counts, no need to look
        self.documents, self.document_mask = (_plain(documents) if documents is not None else None), document_mask
        n_tok = len(tokens)
        num_docs = len(documents) - 1 if documents is not None else -(-n_tok // seq_len)
        num_val = max(0, min(int(round(num_docs * val_fraction)), num_docs - 1))
        if val_fraction > 0 and num_val < 1:  # whole documents cannot give val_fraction: hold out their ends
            self.train, self.val = self._split_tails(num_docs, val_fraction)
            self.val_split = f"the last {val_fraction:.1%} of each document's tokens (too few documents to hold " \
                             "out whole ones)"
        else:
            val_docs = np.sort(np.random.default_rng(seed).choice(num_docs, num_val, replace=False)).astype(np.int64)
            self.train, self.val = self._split(val_docs, num_docs, n_tok)
            self.val_split = f"{num_val:,} whole document(s)"
        self.num_train_windows = max(0, (self.train.length - 1) // seq_len)
        self.num_val_windows = max(0, (self.val.length - 1) // seq_len)
        if self.num_train_windows < 1:
            raise ConfigError(f"{name}: corpus of {n_tok} tokens in {num_docs} documents gives "
                              f"{self.num_train_windows} training windows of train.seq_len={seq_len}; "
                              "use more data, a shorter seq_len or a smaller data.val_fraction")
        self.order = WindowOrder(self.num_train_windows, seed)

    def _bound(self, doc: np.ndarray) -> np.ndarray:
        """Physical start offset of document(s) doc (num_docs = the end of the stream)."""
        if self.documents is not None:
            return np.asarray(self.documents[doc], dtype=np.int64)
        return np.minimum(np.asarray(doc, dtype=np.int64) * self.seq_len, len(self.tokens))

    def _split(self, val_docs: np.ndarray, num_docs: int, n_tok: int) -> tuple[_Stream, _Stream]:
        """Train and validation streams: runs of consecutive documents of each kind."""
        if len(val_docs) == 0:
            return _Stream(np.array([0]), np.array([n_tok])), _Stream(np.array([0]), np.array([0]))
        breaks = np.flatnonzero(np.diff(val_docs) != 1)
        first = np.concatenate([[val_docs[0]], val_docs[breaks + 1]])    # first doc of each val run
        last = np.concatenate([val_docs[breaks], [val_docs[-1]]]) + 1     # one past its last doc
        v_start, v_end = self._bound(first), self._bound(last)
        t_start = np.concatenate([[0], v_end])
        t_end = np.concatenate([v_start, [n_tok]])
        return _Stream(t_start, t_end - t_start), _Stream(v_start, v_end - v_start)

    def _split_tails(self, num_docs: int, val_fraction: float) -> tuple[_Stream, _Stream]:
        """Train and validation streams when whole documents cannot be held out: each document's last
        ceil(length * val_fraction) tokens are validation, the rest of it training."""
        starts = self._bound(np.arange(num_docs))
        ends = self._bound(np.arange(1, num_docs + 1))
        cut = ends - np.ceil((ends - starts) * val_fraction).astype(np.int64)
        return _Stream(starts, cut - starts), _Stream(cut, ends - cut)

    def train_windows(self, samples) -> np.ndarray:
        """Train window index of each global sample (epoch g // n, position g % n)."""
        epoch, pos = np.divmod(np.asarray(samples, dtype=np.int64), self.num_train_windows)
        out = np.empty_like(pos)
        for e in np.unique(epoch):  # a batch spans at most two epochs
            at = epoch == e
            out[at] = self.order(int(e), pos[at])
        return out

    def _pieces(self, stream: _Stream, windows: np.ndarray) -> list:
        """Per window: a physical start p (its S+1 tokens are tokens[p:p+S+1], the usual case), or
        the (S+1,) physical indices of a window that spans two runs of the stream."""
        S = self.seq_len
        v0 = np.asarray(windows, dtype=np.int64) * S
        run = np.searchsorted(stream.vstarts, v0, side="right") - 1
        p0 = stream.starts[run] + (v0 - stream.vstarts[run])
        inside = v0 + S < stream.vstarts[run] + stream.lengths[run]
        return [int(p) if ok else stream.physical(v + np.arange(S + 1)) for p, ok, v in zip(p0, inside, v0)]

    def _gather(self, array: np.ndarray, pieces: list) -> np.ndarray:
        S = self.seq_len
        return np.stack([array[p:p + S + 1] if isinstance(p, int) else array[p] for p in pieces])

    def _rows(self, stream: _Stream, windows: np.ndarray) -> Batch:
        pieces = self._pieces(stream, windows)
        win = self._checked(self._gather(self.tokens, pieces))
        # numpy builds the int64 copies: torch's copy kernels wake its thread pool for a few MB
        inputs, targets = win[:, :-1].astype(np.int64), win[:, 1:].astype(np.int64)
        if self.mask is not None:
            targets[self._gather(self.mask, pieces)[:, 1:] == 0] = IGNORE_INDEX
        positions = torch.from_numpy(self._positions(pieces)) if self.document_mask else None
        return Batch(torch.from_numpy(inputs), torch.from_numpy(targets), positions)

    def _checked(self, win: np.ndarray) -> np.ndarray:
        """win, unless it holds a token id past the tokenizer's: a token file damaged after prepare, which
        data.verify=false (or a rank that does not verify) never read whole, would index past the embedding
        (an IndexError on the CPU, a device-side assert that kills the process on CUDA). One max per batch."""
        if self.vocab is not None and win.size and int(win.max()) >= self.vocab:
            where = os.path.join(self.path, "tokens.bin") if self.path else "the token stream"
            raise ConfigError(f"{self.name}: {where} holds token id {int(win.max())}, past the tokenizer's "
                              f"{self.vocab} tokens: the file changed after it was prepared; delete "
                              f"{self.path or 'the prepared folder'} and prepare again")
        return win

    def _positions(self, pieces: list) -> np.ndarray:
        """(k, S) position of each input token in its document, restarting at the window start."""
        S, k = self.seq_len, len(pieces)
        cols = np.arange(S)
        is_start = np.zeros((k, S), dtype=bool)
        flat = np.array([isinstance(p, int) for p in pieces], dtype=bool)
        rows = np.flatnonzero(flat)
        p0 = np.array([pieces[r] for r in rows], dtype=np.int64)
        if self.documents is None:
            is_start[rows] = (p0[:, None] + cols) % S == 0
        elif len(rows):  # the document starts inside [p0, p0 + S) of every contiguous window, all at once
            lo = np.searchsorted(self.documents, p0, side="left")
            hi = np.searchsorted(self.documents, p0 + S, side="left")
            owner = np.repeat(np.arange(len(rows)), hi - lo)
            first = np.repeat(lo - np.concatenate([[0], np.cumsum(hi - lo)[:-1]]), hi - lo)
            starts = self.documents[first + np.arange(len(owner))] - p0[owner]
            is_start[rows[owner], starts] = True
        for r in np.flatnonzero(~flat):  # a window across held-out documents: look each index up
            phys = pieces[r][:S]
            if self.documents is None:
                is_start[r] = phys % S == 0
            else:
                at = np.searchsorted(self.documents, phys).clip(max=len(self.documents) - 1)
                is_start[r] = self.documents[at] == phys
        return cols - np.maximum.accumulate(np.where(is_start, cols, 0), axis=1)

    def train_batch(self, first_sample: int, count: int) -> Batch:
        return self._rows(self.train, self.train_windows(np.arange(first_sample, first_sample + count)))

    def count_targets(self, first_sample: int, count: int) -> int:
        """Trained targets of samples first..first+count-1, reading only the mask (no batch is built)."""
        return self.count_sample_targets(np.arange(first_sample, first_sample + count))

    def count_sample_targets(self, samples: np.ndarray) -> int:
        if self.mask is None:
            return len(samples) * self.seq_len
        pieces = self._pieces(self.train, self.train_windows(samples))
        return int(self._gather(self.mask, pieces)[:, 1:].astype(bool).sum())

    def val_batch(self, first: int, count: int) -> Batch:
        return self._rows(self.val, (np.arange(first, first + count) % self.num_val_windows).astype(np.int64))

    def signature(self) -> dict:
        return {"num_train_windows": self.num_train_windows, "seed": self.seed,
                **({"tokenizer": self.tokenizer} if self.tokenizer else {})}


class BlendedData:
    """A deterministic weighted mixture of PackedData sources (data.sources)."""

    def __init__(self, parts: list[PackedData], weights: list[float]):
        self.parts, self.weights = parts, [float(w) for w in weights]
        self.seq_len, self.seed = parts[0].seq_len, parts[0].seed
        self.all_trained = all(p.all_trained for p in parts)
        self.pattern = BlendPattern(self.weights)
        self.num_train_windows = sum(p.num_train_windows for p in parts)
        self.val_parts = [d for d, p in enumerate(parts) if p.num_val_windows > 0]
        self.num_val_windows = sum(parts[d].num_val_windows for d in self.val_parts)
        self.val_pattern = BlendPattern([self.weights[d] for d in self.val_parts]) if self.val_parts else None

    @staticmethod
    def _gather(parts, pattern, samples: np.ndarray, fetch) -> Batch:
        src, idx = pattern(samples)
        pieces, rows = [], []
        for d in np.unique(src):
            at = np.flatnonzero(src == d)
            pieces.append(fetch(parts[d], idx[at]))
            rows.append(at)
        order = torch.from_numpy(np.argsort(np.concatenate(rows), kind="stable"))
        cat = lambda name: (torch.cat([getattr(p, name) for p in pieces])[order]  # noqa: E731
                            if getattr(pieces[0], name) is not None else None)
        return Batch(cat("inputs"), cat("targets"), cat("positions"))

    def source_samples(self, first_sample: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        return self.pattern(np.arange(first_sample, first_sample + count))

    def train_batch(self, first_sample: int, count: int) -> Batch:
        return self._gather(self.parts, self.pattern, np.arange(first_sample, first_sample + count),
                            lambda p, idx: p._rows(p.train, p.train_windows(idx)))

    def count_targets(self, first_sample: int, count: int) -> int:
        src, idx = self.source_samples(first_sample, count)
        return sum(self.parts[d].count_sample_targets(idx[src == d]) for d in np.unique(src))

    def val_batch(self, first: int, count: int) -> Batch:
        parts = [self.parts[d] for d in self.val_parts]
        return self._gather(parts, self.val_pattern, np.arange(first, first + count),
                            lambda p, idx: p._rows(p.val, idx % p.num_val_windows))

    def signature(self) -> dict:
        tokenizer = {"tokenizer": self.parts[0].tokenizer} if self.parts[0].tokenizer else {}
        return {"num_train_windows": self.num_train_windows, "seed": self.seed,
                "sources": [p.num_train_windows for p in self.parts], "weights": self.weights, **tokenizer}


def batch_slice(global_batch: int, dp_size: int, dp_rank: int, num_ranks: int = 1,
                split: Optional[dict] = None) -> tuple[int, int]:
    """(first sample inside the global batch, number of samples) of dp ranks dp_rank .. dp_rank + num_ranks - 1
    together: dp ranks read contiguous runs in rank order, so any consecutive ranks (a torchft replica group)
    read one run. Statically each rank reads global_batch / dp_size samples; under a dynamic batch split
    (Loader.use_counts: {"dp_shard", "microbatch", "counts"}) replica r's dp_shard ranks read counts[r]
    microbatches each, after replicas 0 .. r-1."""
    if dp_rank < 0 or num_ranks < 1 or dp_rank + num_ranks > dp_size:
        raise ValueError(f"batch_slice: dp ranks {dp_rank} .. {dp_rank + num_ranks - 1} are not inside dp_size="
                         f"{dp_size}; ask for ranks in [0, {dp_size})")
    if split is None:
        if global_batch % dp_size:
            raise ValueError(f"batch_slice: train.global_batch={global_batch} is not divisible by dp={dp_size}; "
                             "make the global batch a multiple of dp")
        local = global_batch // dp_size
        return dp_rank * local, num_ranks * local
    shard, mb, counts = split["dp_shard"], split["microbatch"], split["counts"]

    def start(rank: int) -> int:  # rank == dp_size: the end of the global batch
        replica, s = divmod(rank, shard)
        return (sum(counts[:replica]) * shard + (s * counts[replica] if s else 0)) * mb
    first = start(dp_rank)
    return first, start(dp_rank + num_ranks) - first


class Loader:
    """Serves each step's batch for one dp rank; its whole state is the number of samples consumed (and,
    under parallel.dynamic_batch, the replicas' microbatch counts)."""

    def __init__(self, data: PackedData | BlendedData, global_batch: int, dp_rank: int, dp_size: int):
        self.data, self.global_batch, self.dp_rank, self.dp_size = data, global_batch, dp_rank, dp_size
        self.samples = 0
        self.split: Optional[dict] = None  # dynamic batch: {"dp_shard", "microbatch", "counts"}
        self.saved_split: Optional[dict] = None  # a checkpoint's split, read by pipetrain.build
        # Context parallelism: Batch -> this cp rank's slice of every sequence, applied to what next() and
        # val_batches() serve (set by pipetrain.build; None keeps whole sequences). Counts stay global.
        self.sequence_slice: Optional[Callable[[Batch], Batch]] = None

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp_size

    def use_counts(self, counts: list[int], dp_shard: int, microbatch: int) -> None:
        """From the next step, replica r (dp ranks r*dp_shard ..) takes counts[r] microbatches of
        `microbatch` samples on each of its dp ranks; the counts cover the global batch."""
        assert sum(counts) * dp_shard * microbatch == self.global_batch, (counts, dp_shard, microbatch)
        self.split = {"dp_shard": dp_shard, "microbatch": microbatch, "counts": list(counts)}

    def rank_slice(self, dp_rank: Optional[int] = None, num_ranks: int = 1) -> tuple[int, int]:
        """(first sample inside the global batch, number of samples) of this dp rank, or of num_ranks dp
        ranks from dp_rank (batch_slice)."""
        first_rank = self.dp_rank if dp_rank is None else dp_rank
        return batch_slice(self.global_batch, self.dp_size, first_rank, num_ranks, self.split)

    def next(self) -> tuple[Batch, int]:
        """(this dp rank's slice of the next global batch, target tokens in the whole global batch). A global
        batch with no trained target (fine-tuning prompts longer than seq_len fill its windows) counts 1: the
        step's loss and gradients are zero, as Megatron-LM clamps its loss mask's sum, and the run goes on."""
        offset, count = self.rank_slice()
        peeked = getattr(self, "_peeked", None)
        if peeked is not None and peeked[0] == (self.samples, offset, count):
            batch = peeked[1]
        else:
            batch = self.data.train_batch(self.samples + offset, count)
        self._peeked = None
        total = self.data.count_targets(self.samples, self.global_batch)
        self.samples += self.global_batch
        return self._sliced(batch), max(total, 1)

    def _sliced(self, batch: Batch) -> Batch:
        return batch if self.sequence_slice is None else self.sequence_slice(batch)

    def peek_inputs(self) -> torch.Tensor:
        """This dp rank's input ids of the next step, without consuming it (the batch is kept for next())."""
        offset, count = self.rank_slice()
        key = (self.samples, offset, count)
        if getattr(self, "_peeked", None) is None or self._peeked[0] != key:
            self._peeked = (key, self.data.train_batch(self.samples + offset, count))
        return self._peeked[1].inputs

    def val_batches(self, num_batches: int):
        """The fixed validation set: num_batches global batches, this rank's slice of each."""
        if self.data.num_val_windows == 0:
            return []
        out = []
        offset, count = batch_slice(self.global_batch, self.dp_size, self.dp_rank)  # no dynamic split here
        for b in range(num_batches):
            out.append(self._sliced(self.data.val_batch(b * self.global_batch + offset, count)))
        return out

    def state_dict(self) -> dict:
        state = {"samples": self.samples, **self.data.signature()}
        if self.split is not None:
            state["dynamic_batch"] = {"dp_replicate": len(self.split["counts"]), **self.split}
        return state

    def load_state_dict(self, state: dict) -> None:
        mine = self.data.signature()
        saved, now = state.get("tokenizer"), mine.pop("tokenizer", None)
        if saved is not None and now is not None and saved != now:  # (older checkpoints record none)
            raise ConfigError(f"checkpoint data was tokenized by a tokenizer of fingerprint {saved}, but this run's "
                              f"data.tokenizer gives {now} (the same size, other tokens); resume with the tokenizer "
                              "the run was trained with")
        if any(state.get(k) != v for k, v in mine.items()):
            raise ConfigError(f"checkpoint data position was saved for {state.get('num_train_windows')} windows "
                              f"and data.seed={state.get('seed')}, but this data gives {mine['num_train_windows']} "
                              f"and data.seed={mine['seed']}; resume with the same data, seq_len and seed")
        self.samples = int(state["samples"])
        self.saved_split = state.get("dynamic_batch")  # the trainer keeps it when the layout is the same
