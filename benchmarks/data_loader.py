"""Data benchmark: loader cost per sample, prepare throughput, per-rank peak RSS of a short run.

    python benchmarks/data_loader.py [--part loader|prepare|rss|all] [--prepare-mb 20] [--big-tokens 2.5e9]

loader:  Loader.next() cost per sample (seq 2048, global batch 64, dp 1, first step excluded) on synthetic
         prepared corpora of 10M and 2.5B tokens. The token file is sparse (truncate: reads are zero pages,
         ~5 GB of address space for 2.5B uint16 tokens and no disk); documents.bin holds real offsets
         (documents of 1000 tokens), so the document split and positions cost what they would.
prepare: python -m pipetrain.data prepare's path (pipetrain.data.prepare) on the shipped Shakespeare corpus
         repeated to --prepare-mb of text, num_proc 1 and 2; tokens/s over the whole call (load, map, write).
rss:     peak RSS of `train.py` (the tiny recipe cut to 3 steps, one process) on the shipped corpus and on the
         synthetic 2.5B-token prepared corpus (data.verify=false: hashing 5 GB of zeros measures the disk).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pipetrain.data import Loader, load_tokenizer, open_prepared, prepare  # noqa: E402
from pipetrain.data.corpus import FORMAT_VERSION, MANIFEST, token_dtype, tokenizer_fingerprint  # noqa: E402
from pipetrain.data.loader import PackedData  # noqa: E402

TOKENIZER = os.path.join(ROOT, "pipetrain", "assets", "tokenizer")
SHAKESPEARE = os.path.join(ROOT, "pipetrain", "assets", "shakespeare")
TINY = os.path.join(ROOT, "recipes", "tiny.yaml")


def write_synthetic(path: str, num_tokens: int, tokenizer, doc_len: int = 1000) -> str:
    """A prepared directory with a sparse token file of num_tokens and documents of doc_len tokens."""
    os.makedirs(path, exist_ok=True)
    dtype = token_dtype(len(tokenizer))
    with open(os.path.join(path, "tokens.bin"), "wb") as f:
        f.truncate(num_tokens * dtype.itemsize)
    offsets = np.minimum(np.arange(0, num_tokens + doc_len, doc_len, dtype=np.int64), num_tokens)
    offsets = np.unique(offsets)
    offsets.tofile(os.path.join(path, "documents.bin"))
    files = {"tokens.bin": {"size": num_tokens * dtype.itemsize, "sha256": "synthetic"},
             "documents.bin": {"size": offsets.nbytes, "sha256": "synthetic"}}
    manifest = {"format": FORMAT_VERSION, "tokenizer": {"fingerprint": tokenizer_fingerprint(tokenizer),
                                                         "name": TOKENIZER, "vocab_size": len(tokenizer),
                                                         "eos_token_id": tokenizer.eos_token_id},
                "dtype": dtype.name, "num_tokens": num_tokens, "num_documents": len(offsets) - 1,
                "has_mask": False, "text_field": "text", "path": "synthetic", "sources": [{"name": "synthetic"}],
                "files": files}
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(manifest, f)
    return path


def bench_loader(tmp: str, tokenizer, sizes: list[int]) -> None:
    for n in sizes:
        path = write_synthetic(os.path.join(tmp, f"synthetic-{n}"), n, tokenizer)
        corpus = open_prepared(path, tokenizer)
        start = time.perf_counter()
        data = PackedData(corpus.tokens, corpus.mask, 2048, 0.05, 1234, corpus.documents)
        setup = time.perf_counter() - start
        for document_mask in (False, True):
            data.document_mask = document_mask
            loader = Loader(data, 64, 0, 1)
            steps, timings = 20, []
            for _ in range(2):  # the first pass touches the pages (cold for the first setting), the second not
                loader.samples = 0
                start = time.perf_counter()
                for _ in range(steps):
                    loader.next()
                timings.append((time.perf_counter() - start) / (steps * 64) * 1e6)
            print(f"loader {n / 1e6:,.0f}M tokens ({data.num_train_windows:,} train windows, setup {setup:.2f} s), "
                  f"document_mask={document_mask}: {timings[1]:.1f} us per sample (first pass {timings[0]:.1f})",
                  flush=True)


def bench_prepare(tmp: str, tokenizer, megabytes: float) -> None:
    raw = os.path.join(tmp, "raw")
    os.makedirs(raw, exist_ok=True)
    plays = sorted(f for f in os.listdir(SHAKESPEARE) if f.endswith(".txt"))
    size, copy = 0, 0
    while size < megabytes * 1e6:
        for play in plays:
            dst = os.path.join(raw, f"{copy:03d}_{play}")
            shutil.copy(os.path.join(SHAKESPEARE, play), dst)
            size += os.path.getsize(dst)
        copy += 1
    for num_proc in (1, 2):
        cache = os.path.join(tmp, f"cache-{num_proc}")
        start = time.perf_counter()
        out = prepare(raw, tokenizer, cache_dir=cache, num_proc=num_proc, progress=False)
        seconds = time.perf_counter() - start
        tokens = open_prepared(out).manifest["num_tokens"]
        print(f"prepare {size / 1e6:.0f} MB of text ({tokens:,} tokens), num_proc={num_proc}: {seconds:.1f} s, "
              f"{tokens / seconds:,.0f} tokens/s", flush=True)


def _peak_rss_of_run(out: str, data_path: str, cache: str) -> float:
    sets = ["model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
            "model.max_seq_len=32", "train.seq_len=32", "train.global_batch=8", "train.steps=3",
            "run.eval_every=0", "run.eval_batches=2", "run.sample_tokens=0", "run.progress=false",
            f"run.output_dir={out}", f"data.path={data_path}", f"data.cache_dir={cache}", "data.verify=false"]
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--recipe", TINY] + [a for s in sets for a in ("--set", s)]
    # a fresh parent per run: RUSAGE_CHILDREN's maxrss is the largest child so far, never reset
    probe = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss if p.returncode == 0 else -1)")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", probe] + cmd, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    peak = int(proc.stdout.strip().splitlines()[-1])  # KiB
    assert peak > 0, proc.stderr[-3000:]
    print(f"  run took {time.perf_counter() - start:.1f} s")
    return peak / 1024


def bench_rss(tmp: str, tokenizer, big_tokens: int) -> None:
    cache = os.path.join(tmp, "rss-cache")
    prepare(SHAKESPEARE, tokenizer, cache_dir=cache, progress=False)  # the launch itself then only opens it
    big = write_synthetic(os.path.join(tmp, f"synthetic-{big_tokens}"), big_tokens, tokenizer)
    for name, path in [("synthetic prepared corpus", big), ("shipped corpus", SHAKESPEARE)]:
        mib = _peak_rss_of_run(os.path.join(tmp, "run-" + name.split()[0]), path, cache)
        print(f"peak RSS, tiny run (3 steps) on the {name}: {mib:.0f} MiB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=["loader", "prepare", "rss", "all"], default="all")
    parser.add_argument("--prepare-mb", type=float, default=20.0)
    parser.add_argument("--big-tokens", type=float, default=2.5e9)
    args = parser.parse_args()
    tokenizer = load_tokenizer(TOKENIZER)
    with tempfile.TemporaryDirectory(prefix="pipetrain-data-bench-") as tmp:
        if args.part in ("loader", "all"):
            bench_loader(tmp, tokenizer, [10_000_000, int(args.big_tokens)])
        if args.part in ("prepare", "all"):
            bench_prepare(tmp, tokenizer, args.prepare_mb)
        if args.part in ("rss", "all"):
            bench_rss(tmp, tokenizer, int(args.big_tokens))


if __name__ == "__main__":
    main()
