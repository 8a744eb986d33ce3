"""Sample order in O(1) per sample and memory: a seeded bijection per epoch, and blend patterns.

WindowOrder(n, seed)(epoch, positions) maps positions 0..n-1 of an epoch to window indices: a 4-round
Feistel network over the smallest even number of bits covering n, keyed by (seed, epoch, round), with
cycle walking (a value >= n is permuted again until it lands below n; a bijection on [0, n) because the
network is a bijection on its whole domain, which is at most 4n, so under 4 rounds of walking on average).
Nothing is stored: sample g of a run reads window WindowOrder(n, seed)(g // n, g % n), the same for every
layout, and the loader position stays one integer.

BlendPattern(weights) assigns global samples to sources: in every chunk of CHUNK samples, source d's k-th
sample is due at (k + 1/2) / w_d, and the chunk takes the CHUNK earliest (ties to the lower source), as
Megatron's blended index does greedily. Every chunk is the same pattern, so sample i is source
pattern[i % CHUNK] with per-source index (i // CHUNK) * count[d] + k: O(1), and every prefix of n samples
holds n * w_d of source d to within a sample or two per chunk.
"""
from __future__ import annotations

import numpy as np

_M64 = (1 << 64) - 1
CHUNK = 1 << 16


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping multiplication is the point)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class WindowOrder:
    """A seeded permutation of range(n) for each epoch, computed per element (no table)."""

    ROUNDS = 4

    def __init__(self, n: int, seed: int):
        assert n >= 1, "an order needs at least one window"
        self.n, self.seed = n, seed
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.low = np.uint64((1 << self.half) - 1)

    def _keys(self, epoch: int) -> np.ndarray:
        base = [(self.seed * 0x9E3779B97F4A7C15 + epoch * 0xD1B54A32D192ED03 + r * 0x8CB92BA72F3D8DD7) & _M64
                for r in range(self.ROUNDS)]
        return _mix(np.asarray(base, dtype=np.uint64))

    def _permute(self, x: np.ndarray, keys: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half)
        left, right = x >> shift, x & self.low
        for key in keys:
            left, right = right, left ^ (_mix(right ^ key) & self.low)
        return (left << shift) | right

    def __call__(self, epoch: int, positions) -> np.ndarray:
        """Window indices (int64) of the given positions of `epoch`."""
        pos = np.asarray(positions, dtype=np.int64)
        assert ((pos >= 0) & (pos < self.n)).all(), "positions lie in [0, n)"
        keys = self._keys(epoch)
        out = self._permute(pos.astype(np.uint64), keys)
        outside = out >= np.uint64(self.n)
        while outside.any():
            out[outside] = self._permute(out[outside], keys)
            outside = out >= np.uint64(self.n)
        return out.astype(np.int64)


class BlendPattern:
    """Deterministic weighted mixture of sources: sample i -> (source, index within that source)."""

    def __init__(self, weights: list[float], chunk: int = CHUNK):
        w = np.asarray(weights, dtype=np.float64)
        assert len(w) >= 1 and (w > 0).all(), "weights are positive"
        w = w / w.sum()
        self.chunk, self.weights = chunk, w
        due, source, index = [], [], []
        for d, wd in enumerate(w):
            k = np.arange(int(np.ceil(chunk * wd)) + 2)
            due.append((k + 0.5) / wd)
            source.append(np.full(len(k), d))
            index.append(k)
        due, source, index = np.concatenate(due), np.concatenate(source), np.concatenate(index)
        take = np.lexsort((source, due))[:chunk]  # earliest due first, lower source on ties
        self.source = source[take].astype(np.int64)
        self.index = index[take].astype(np.int64)
        self.count = np.bincount(self.source, minlength=len(w)).astype(np.int64)

    def __call__(self, samples) -> tuple[np.ndarray, np.ndarray]:
        """(source, index within that source's own sample sequence) of each global sample."""
        q, j = np.divmod(np.asarray(samples, dtype=np.int64), self.chunk)
        src = self.source[j]
        return src, q * self.count[src] + self.index[j]
