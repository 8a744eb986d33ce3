"""Hugging Face import and export: time and peak memory for a ~100M llama-style model on CPU.

    python benchmarks/hf_io.py [--repeats 3] [--threads 2] [--workdir DIR]

Setup (once): transformers builds a LlamaConfig model (vocab 32000, d 768, 8 layers, 12 heads, 4 kv
heads, ffn 2048, untied: 99.6M parameters, 398 MB in fp32) with random weights and saves it twice,
as one model.safetensors and as a sharded index (100MB shards); the same weights under pipetrain's
global names go to ckpt.safetensors, standing in for a checkpoint's full-tensor reader.

Each measurement runs in a fresh subprocess. Peak memory is peak RSS: /proc/self/status VmHWM (the
counter getrusage reports as ru_maxrss) reset through /proc/self/clear_refs just before the timed
work, minus the RSS at that moment, so imports and (for export_model) the loaded model are not
counted. RSS includes touched pages of memory-mapped files, which matters because safetensors maps
the files it reads. tracemalloc is not used: it does not see torch's allocator. Times are wall-clock
medians over --repeats processes; one-off imports (transformers' config classes) happen before.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from common import ROOT  # noqa: F401  (importing common puts the checkout on sys.path)
from safetensors.torch import save_file

from pipetrain.hf.config import model_config_from_hf
from pipetrain.hf.export import export_model, export_state
from pipetrain.hf.weights import load_hf_weights
from pipetrain.models import build, materialize

MB = 1e6
HF_MODEL = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
                tie_word_embeddings=False)
KINDS = {
    "import": "model_config_from_hf + load_hf_weights into a meta-built model (one model.safetensors)",
    "import_sharded": "the same from a sharded model.safetensors.index.json (100MB shards)",
    "materialize": "reference: random init of the same model (build on meta + materialize)",
    "from_pretrained": "reference: transformers from_pretrained of the same folder, every weight touched once",
    "export_stream": "export_state fed one tensor at a time by a plain-read() reader (2GB shards: one file)",
    "export_model": "export_model of a model already in memory (memory above the loaded model)",
}


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_bytes() -> int:
    """VmHWM: the counter getrusage reports as ru_maxrss, but resettable with _reset_peak()."""
    try:
        return _status_bytes("VmHWM")
    except RuntimeError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def read_tensors_without_mmap(path: str):
    """(name, tensor) of a safetensors file, one plain read() per tensor: unlike safe_open, which maps
    the whole file, the process then holds only the tensor being handed out (a checkpoint reader's job)."""
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        for name, info in header.items():
            lo, hi = info["data_offsets"]
            f.seek(8 + size + lo)
            data = bytearray(hi - lo)
            f.readinto(data)
            tensor = torch.frombuffer(data, dtype=dtypes[info["dtype"]]).reshape(info["shape"])
            yield name, tensor
            del data, tensor  # before reading the next one, as a streaming reader must


def setup(workdir: str) -> None:
    """Save the HF model (single file and sharded) and the pipetrain-named tensors once."""
    from transformers import AutoModelForCausalLM, LlamaConfig  # deferred: heavy, timed separately below

    if os.path.isfile(os.path.join(workdir, "ckpt.safetensors")):
        return
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**HF_MODEL))
    model.save_pretrained(os.path.join(workdir, "hf"))
    model.save_pretrained(os.path.join(workdir, "hf_sharded"), max_shard_size="100MB")
    del model
    cfg = model_config_from_hf(os.path.join(workdir, "hf"))
    ours = load_hf_weights(build(cfg), os.path.join(workdir, "hf"), cfg)
    save_file({n: p.detach().contiguous() for n, p in ours.named_parameters()},
              os.path.join(workdir, "ckpt.safetensors"))


def measure(kind: str, workdir: str) -> dict:
    """Run one measurement in this (fresh) process; returns seconds and bytes."""
    hf_dir = os.path.join(workdir, "hf_sharded" if kind == "import_sharded" else "hf")
    out_dir = tempfile.mkdtemp(dir=workdir)
    cfg = model_config_from_hf(os.path.join(workdir, "hf"))
    build(cfg)  # first build pays one-off lazy imports; keep them out of the figures
    if kind in ("from_pretrained", "export_stream", "export_model"):
        import transformers  # export writes config.json with its config classes; their import (~5 s
        transformers.logging.set_verbosity_error()  # on this machine, once per process) is not counted
        transformers.LlamaConfig, transformers.LlamaForCausalLM, transformers.AutoModelForCausalLM
    if kind == "export_model":
        model = load_hf_weights(build(cfg), hf_dir, cfg)
    base = _status_bytes("VmRSS")
    reset = _reset_peak()
    t0 = time.perf_counter()
    if kind in ("import", "import_sharded"):
        load_hf_weights(build(cfg), hf_dir, cfg)
    elif kind == "materialize":
        materialize(build(cfg), cfg, 0, "cpu")
    elif kind == "from_pretrained":
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
        for p in hf_model.parameters():  # transformers 5 maps the file lazily: touch each weight once
            p.sum()
    elif kind == "export_stream":
        export_state(read_tensors_without_mmap(os.path.join(workdir, "ckpt.safetensors")), cfg, out_dir)
    elif kind == "export_model":
        export_model(model, cfg, out_dir)
    seconds = time.perf_counter() - t0
    peak = _peak_bytes()
    written = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
    largest = max(p.numel() * 4 for p in build(cfg).parameters())
    return {"kind": kind, "seconds": seconds, "extra_peak_bytes": peak - base, "peak_was_reset": reset,
            "written_bytes": written, "largest_tensor_bytes": largest, "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", default=None, help="reuse saved models here (default: a temp dir)")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        torch.set_num_threads(args.threads)
        print(json.dumps(measure(args.measure, args.workdir)))
        return
    workdir = args.workdir or tempfile.mkdtemp(prefix="pipetrain-hf-io-")
    os.makedirs(workdir, exist_ok=True)
    setup(workdir)
    print(f"model: llama {HF_MODEL}; workdir {workdir}")
    print("| what | median s | peak extra RSS MB (max) | notes |")
    print("|---|---|---|---|")
    for kind, what in KINDS.items():
        runs = []
        for _ in range(args.repeats):
            out = subprocess.run([sys.executable, __file__, "--measure", kind, "--workdir", workdir,
                                  "--threads", str(args.threads)], capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        seconds = statistics.median(r["seconds"] for r in runs)
        extra = max(r["extra_peak_bytes"] for r in runs) / MB
        note = what
        if kind.startswith("export"):
            note += (f"; wrote {runs[0]['written_bytes'] / MB:.0f} MB; largest tensor "
                     f"{runs[0]['largest_tensor_bytes'] / MB:.0f} MB")
        if not all(r["peak_was_reset"] for r in runs):
            note += " (peak not resettable here: includes the process's earlier peak)"
        print(f"| {kind} | {seconds:.2f} | {extra:.0f} | {note} |", flush=True)


if __name__ == "__main__":
    main()
