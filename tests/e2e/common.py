"""Run train.py (one process or torchrun) on a small recipe and read its metrics.jsonl."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import torch
from safetensors import safe_open
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from pipetrain import cli
from tests.harness import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "recipes", "tiny.yaml")

# The tiny recipe cut down to seconds: same corpus and tokenizer, a 4-layer d=64 model. Its weights are
# far below the default fusion threshold: fuse them all, so that every run takes the in-place gradient
# accumulation (plain F.linear is covered by the fusion-off e2e run and tests/unit/test_linear.py).
SMALL = ["train.grad_accumulation_fusion_min_numel=0",
         "model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
         "model.max_seq_len=32", "train.seq_len=32", "train.global_batch=8", "train.steps=20",
         "train.warmup_steps=2", "train.lr=3e-3", "run.eval_every=10", "run.eval_batches=2", "run.log_every=1",
         "run.sample_tokens=0", "run.progress=false"]


def run_train(out_dir: str, overrides: list[str] = (), nproc: int = 1, recipe: str = TINY, extra_args=(),
              cache_dir: str | None = None, timeout: int = 600, base=SMALL,
              launcher_args=(), cuda: bool = False) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """train.py on the tiny recipe (cut down by `base`) with overrides; nproc > 1 under torchrun, with
    launcher_args (e.g. --max-restarts=1) before the script. Returns the process and metrics.jsonl.
    cuda False: the run sees no GPU (a CPU test); True (`gpu` tests): the GPU, with compiled Triton."""
    sets = list(base) + [f"run.output_dir={out_dir}"] + list(overrides)
    if cache_dir:
        sets.append(f"data.cache_dir={cache_dir}")
    args = ["--recipe", recipe] + [a for s in sets for a in ("--set", s)] + list(extra_args)
    if nproc == 1:
        cmd = [sys.executable, os.path.join(ROOT, "train.py")] + args
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               *launcher_args, os.path.join(ROOT, "train.py")] + args
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if cuda:
        env.pop("TRITON_INTERPRET", None)  # tests/conftest.py sets it for the in-process CPU kernel tests
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if nproc == 1 and not cuda:  # train.py in a fork of the test harness's server: no seconds of imports
        proc = run_script(os.path.join(ROOT, "train.py"), args, env, timeout=timeout)
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    return proc, read_metrics(out_dir)


def refused_in_process(capsys, out_dir: str, overrides: list[str] = (), extra_args=()) -> str:
    """The one `error:` line of a one-process train.py run that must exit 2 before it trains, run through
    pipetrain.cli.main in this process (as train.py calls it): a subprocess would spend seconds importing
    torch again for a check that reads only the recipe. No traceback may reach stderr."""
    sets = list(SMALL) + [f"run.output_dir={out_dir}"] + list(overrides)
    code = cli.main(["--recipe", TINY] + [a for s in sets for a in ("--set", s)] + list(extra_args))
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.strip().startswith("error: ")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err[-2000:])
    return lines[0]


def checkpoint_tensors(ckpt_dir) -> dict:
    """Every tensor of a checkpoint folder by name, except the per-rank RNG states."""
    out = {}
    for file in sorted(os.listdir(ckpt_dir)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(ckpt_dir, file), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys() if not k.startswith("rng/")})
    return out


def read_metrics(out_dir: str) -> list[dict]:
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def step_losses(metrics: list[dict]) -> list[float]:
    return [m["loss"] for m in metrics if "loss" in m]


def save_tiny_hf_llama(out) -> None:
    """A tiny random llama (vocab 8192, d 64, 2 layers, untied) with the shipped tokenizer, saved like a
    hub download: config, weights and tokenizer."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(out)
    AutoTokenizer.from_pretrained(os.path.join(ROOT, "pipetrain", "assets", "tokenizer")).save_pretrained(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def lighthouse(heartbeat_s: float = 5.0):
    """A torchft lighthouse on a free port that declares a replica group dead after heartbeat_s without a
    heartbeat; yields its address for TORCHFT_LIGHTHOUSE (tests/e2e/test_torchft.py, benchmarks/failover.py)."""
    binary = shutil.which("torchft_lighthouse") or os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    port = _free_port()
    proc = subprocess.Popen([binary, "--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
                             "--heartbeat_timeout_ms", str(int(heartbeat_s * 1000)), "--bind", f"[::]:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:  # ready once it accepts connections
            with contextlib.suppress(OSError), socket.create_connection(("localhost", port), timeout=1):
                break
            assert proc.poll() is None and time.monotonic() < deadline, "torchft_lighthouse did not start"
            time.sleep(0.05)
        yield f"http://localhost:{port}"
    finally:
        proc.kill()
        proc.wait()


def worker_pid(out_dir: str, rank: int) -> int | None:
    """PID of the train.py worker of global rank `rank` that torchrun started for the run writing to out_dir
    (its command line names out_dir, so no other run on the machine matches; torchrun's agent is skipped)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            if f"run.output_dir={out_dir}".encode() not in cmdline or b"torch.distributed.run" in cmdline:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"RANK={rank}".encode() in f.read().split(b"\0"):
                    return int(pid)
        except OSError:  # gone, or not ours to read
            continue
    return None
