"""Peak memory of `prepare` on one-line text files (a corpus with no newline is one document).

    python benchmarks/prepare_memory.py [--mb 5 20 200]

Each size runs in a fresh process (the same call as `python -m pipetrain.data prepare`) on a file of
that many MB of words with single spaces and no newline; the process reports its own VmHWM (peak
resident set; ru_maxrss would carry over the launching process's peak through exec). Prints one JSON
line per size: MB, peak GiB, seconds, tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "pipetrain", "assets", "tokenizer")
WORDS = ["the", "king", "doth", "wake", "tonight", "and", "takes", "his", "rouse", "keeps", "wassail"]
PROBE = """
import json, sys
from pipetrain.data import load_tokenizer, prepare
tokenizer = load_tokenizer({tokenizer!r})
out = prepare({path!r}, tokenizer, cache_dir={cache!r}, out_dir={out!r}, progress=False)
peak = [int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM")][0]
print(json.dumps({{"peak_bytes": peak, "tokens": json.load(open(out + "/manifest.json"))["num_tokens"]}}))
"""


def one_line_file(path: str, megabytes: int) -> None:
    """megabytes MB of space-separated words, written in 8 MB blocks (no newline anywhere)."""
    rng = np.random.default_rng(0)
    words = np.array(WORDS)
    left = megabytes * 1024 * 1024
    with open(path, "w") as f:
        while left > 0:
            block = " ".join(words[rng.integers(0, len(words), 2 * 1024 * 1024)]) + " "
            f.write(block[:left])
            left -= min(left, len(block))


def measure(megabytes: int, tmp: str) -> dict:
    path = os.path.join(tmp, f"line-{megabytes}mb.txt")
    one_line_file(path, megabytes)
    probe = PROBE.format(tokenizer=TOKENIZER, path=path, cache=os.path.join(tmp, "cache"),
                         out=os.path.join(tmp, f"prepared-{megabytes}"))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"mb": megabytes, "error": proc.stderr.strip().splitlines()[-1:], "returncode": proc.returncode}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    os.remove(path)
    return {"mb": megabytes, "peak_gib": round(result["peak_bytes"] / 2**30, 3), "seconds": round(seconds, 1),
            "tokens": result["tokens"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, nargs="+", default=[5, 20, 200])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pipetrain-prepare-mem-") as tmp:
        for mb in args.mb:
            print(json.dumps(measure(mb, tmp)), flush=True)


if __name__ == "__main__":
    main()
