"""Run a function on several gloo processes on CPU, as STYLE.md section 6 describes.

Workers fork from a server that has already imported torch and pipetrain (_PRELOAD). Rendezvous is
through a file in a temporary directory: no ports, no retries. Any rank's exception fails the test
(start_processes re-raises it with the rank's traceback). Also the tiny random Hugging Face models that
the import/export tests in tests/unit and tests/dist share.
"""
from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import re
import runpy
import subprocess
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# This checkout's own code; frames from anywhere else (torchrun, the venv) are not ours.
OUR_CODE = tuple(os.path.realpath(os.path.join(ROOT, p)) for p in ("pipetrain", "kernels", "train.py"))

# fp32 tolerances used across the parallel tests, each with the reason it is needed.
EXACT_FP32 = dict(rtol=1e-5, atol=1e-6)  # pp / dp: same ops, only gradient-accumulation order differs
TP_FP32 = dict(rtol=1e-4, atol=1e-5)     # tp splits reductions over D and F, changing summation order


# The wrong-device mode: PIPETRAIN_TEST_DEFAULT_DEVICE=meta (or run_ranks(default_device="meta")) makes
# every tensor built without `device=` in a worker a meta tensor. The gloo groups take CPU tensors only,
# so such a tensor reaching a collective fails comm's device check (CommDeviceError), as a CPU tensor
# built the same way would crash NCCL on a GPU run, where the default device is not the mesh's either.
DEFAULT_DEVICE_ENV = "PIPETRAIN_TEST_DEFAULT_DEVICE"


# Workers start from a fork server that has already imported torch, dynamo and pipetrain (the first run_ranks
# or run_script call starts it): a spawned worker spends seconds importing them again (torch.optim's
# Optimizer imports torch._dynamo when it is built: 2 s of every training process), which summed over the
# suite's multi-process tests and one-process train.py runs was minutes of its run time. The server forks
# clean processes (it never runs a test, never touches CUDA), so each worker starts from freshly imported
# modules, as a spawned one does. Workers take the environment their caller saw (a fork server keeps the
# one it started with): see _worker and _script.
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "pipetrain.build", "pipetrain.trainer", "tests.harness"]
_PYTHONPATH = os.environ.get("PYTHONPATH")  # the fork server's import path is this process's


def _worker(rank: int, world_size: int, init_file: str, timeout_s: float, default_device, fn, args, env=None):
    if env is not None:  # the caller's environment at run_ranks time (tests set variables with monkeypatch)
        os.environ.clear()
        os.environ.update(env)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    if default_device:
        torch.set_default_device(default_device)
    try:
        fn(rank, world_size, *args)
    finally:
        gc.collect()  # communication handles held in reference cycles go now, not at interpreter exit
        dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args, timeout_s: float = 300, default_device: str | None = None) -> None:
    """Run fn(rank, world_size, *args) on world_size gloo processes; any rank's exception fails the test.
    timeout_s bounds each collective (a hang fails instead of blocking forever). default_device: the
    workers' torch default device ("meta": the wrong-device mode above); None reads DEFAULT_DEVICE_ENV."""
    default_device = default_device or os.environ.get(DEFAULT_DEVICE_ENV) or None
    with tempfile.TemporaryDirectory() as tmp, _without_gpu():
        multiprocessing.set_forkserver_preload(_PRELOAD)
        mp.start_processes(_worker, args=(world_size, os.path.join(tmp, "rdzv"), timeout_s, default_device, fn,
                                          args, dict(os.environ)),
                           nprocs=world_size, start_method="forkserver")


def _script(target: str, args: list[str], env: dict, cwd: str, stdout: str, stderr: str) -> None:
    """`python target *args` (a .py file, or a module as for -m) in a fork of the server, with env and cwd,
    its standard output and error (the file descriptors, so C code's writes too) going to files."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or os.cpu_count()))
    for fd, path in ((1, stdout), (2, stderr)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(file, fd)
        os.close(file)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.argv = [target, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(target)) if target.endswith(".py") else cwd)  # as python's
    if target.endswith(".py"):
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)


def _text(path: str) -> str:
    if not os.path.exists(path):  # the fork died before it opened its streams
        return ""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def run_script(target: str, args: list[str], env: dict | None = None, cwd: str = ROOT,
               timeout: float | None = None) -> subprocess.CompletedProcess:
    """subprocess.run([sys.executable, target or -m target, *args], capture_output=True, text=True, env=env,
    cwd=cwd, timeout=timeout), run in a fork of the server above instead: the same script in a process of
    its own, without its seconds of imports. Exit status as Python gives it (sys.exit's code; 1 and the
    traceback on stderr for an exception; minus the signal for a signal). An env whose PYTHONPATH is not
    this process's (a stand-in package) needs a real interpreter: it gets one. env None: this process's.
    Unlike a fresh interpreter: a variable that a preloaded module reads when imported (TRITON_INTERPRET,
    TORCH_LOGS) keeps the server's value, and atexit handlers do not run (pipetrain registers none)."""
    env = dict(os.environ) if env is None else env
    cmd = [sys.executable, *([target] if target.endswith(".py") else ["-m", target]), *args]
    if env.get("PYTHONPATH") != _PYTHONPATH:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    multiprocessing.set_forkserver_preload(_PRELOAD)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        proc = multiprocessing.get_context("forkserver").Process(target=_script,
                                                                 args=(target, list(args), env, cwd, out, err))
        proc.start()
        proc.join(timeout)
        timed_out = proc.exitcode is None
        if timed_out:
            proc.kill()
            proc.join()
        read = [_text(out), _text(err)]
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=read[0], stderr=read[1])
    return subprocess.CompletedProcess(cmd, proc.exitcode, read[0], read[1])


@contextlib.contextmanager
def _without_gpu():
    """The gloo workers see no GPU (they inherit the environment at spawn): on a CUDA machine they would
    otherwise all pick cuda:0 (ParallelDims' default device), several ranks on one GPU."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def _keep_result(rank: int, world_size: int, fn, out: str, args: tuple) -> None:
    result = fn(rank, world_size, out, *args)
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


def rank_results(world_size: int, fn, out: str, *args, default_device: str | None = None,
                 timeout_s: float = 300) -> list:
    """Run fn(rank, world_size, out, *args) on world_size gloo processes and return each rank's return
    value, in rank order (saved under out by torch.save, read back here; default_device, timeout_s: run_ranks')."""
    run_ranks(world_size, _keep_result, fn, out, args, default_device=default_device, timeout_s=timeout_s)
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def our_traceback_frames(text: str) -> list[str]:
    """Files of the Python traceback frames in text that lie in this checkout's code (pipetrain/, kernels/,
    train.py), compared as real paths, so a checkout or venv whose path contains "pipetrain" is no false hit."""
    frames = re.findall(r'^\s*File "([^"]+)", line \d+', text, flags=re.MULTILINE)
    return [f for f in frames
            if any(os.path.realpath(f) == ours or os.path.realpath(f).startswith(ours + os.sep) for ours in OUR_CODE)]


# ---- tiny random Hugging Face models (tests/unit/test_hf.py, tests/dist/test_hf_parallel.py) ----

HF_FP32 = dict(rtol=1e-5, atol=1e-5)  # same math; gelu_new vs F.gelu(tanh) and fused matmuls differ in round-off
B, T = 2, 16
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64)


def hf_configs() -> dict:
    """One tiny model per family, each exercising what that family adds."""
    import transformers as tf  # deferred: heavy, and only the Hugging Face tests need it

    return {
        "llama": tf.LlamaConfig(num_key_value_heads=2, rope_theta=5000.0, rms_norm_eps=1e-6, **SMALL),  # GQA
        "qwen2": tf.Qwen2Config(num_key_value_heads=2, **SMALL),  # q/k/v biases
        "mistral": tf.MistralConfig(num_key_value_heads=1, sliding_window=5, **SMALL),  # window < T, one kv head
        "gpt2": tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                              bos_token_id=0, eos_token_id=0),  # tied, fused c_attn, Conv1D
    }


def moe_hf_configs() -> dict:
    """One tiny mixture of experts per MoE family (4 experts, 2 per token: some tokens leave an expert empty)."""
    import transformers as tf  # deferred: heavy, and only the Hugging Face tests need it

    moe = dict(num_key_value_heads=2, num_experts_per_tok=2, **{k: v for k, v in SMALL.items()
                                                                  if k != "intermediate_size"})
    return {
        "mixtral": tf.MixtralConfig(num_local_experts=4, intermediate_size=24, sliding_window=None, **moe),
        "qwen3_moe": tf.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=24, intermediate_size=48, head_dim=12,
                                       norm_topk_prob=False, **moe),  # head_dim != hidden/heads, no renormalising
    }


def save_tiny_hf(hf_config, out_dir: str, seed: int = 0, **save_kwargs):
    """A transformers model with every parameter random (std 0.3), saved to out_dir; returns it (eval)."""
    from transformers import AutoModelForCausalLM  # deferred: heavy, only the Hugging Face tests need it

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # norms stay near 1 but differ per layer and channel
    model.save_pretrained(out_dir, **save_kwargs)
    return model


def tokens(vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(5))


def saved_activation_bytes(model, inputs, targets=None, autocast=None, positions=None) -> int:
    """Bytes of the unique non-parameter storages autograd saves for backward in one forward of model
    (what activations cost between forward and backward); runs the backward and clears the grads.
    targets None: the model ends before the head (a middle pipeline stage) and out.sum() is the loss.
    positions: passed to the model when given (document masks, a context-parallel slice)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with autocast if autocast is not None else contextlib.nullcontext():
            out = model(inputs) if positions is None else model(inputs, positions)
        loss = (torch.nn.functional.cross_entropy(out.float().flatten(0, 1), targets.flatten())
                if targets is not None else out.sum())
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())
