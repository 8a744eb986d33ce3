"""Generation: the KV-cached decode equals the uncached decoder, greedy output equals transformers'
greedy generate on tiny random Hugging Face models, and the command reads checkpoints and HF folders."""
import json
import os
import shutil

import pytest
import torch

from pipetrain.config import ModelConfig
from pipetrain.generate import KVCache, choose_token, forward_cached, generate_tokens, load_for_generation
from pipetrain.generate.__main__ import main as generate_main
from pipetrain.generate.load import latest_checkpoint
from pipetrain.hf.config import model_config_from_hf
from pipetrain.hf.weights import load_hf_weights
from pipetrain.models import build, materialize
from tests.e2e.common import run_train
from tests.unit.short_run import short_run
from tests.unit.test_hf import TOKENIZER, hf_configs, save_tiny_hf

CACHE_FP32 = dict(rtol=1e-5, atol=1e-5)  # the cached path attends over the same keys in another summation order
FAMILIES = {
    "llama": ModelConfig(family="llama", vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         max_seq_len=32),
    "qwen2": ModelConfig(family="qwen2", vocab_size=96, d_model=32, n_layers=2, n_heads=4, max_seq_len=32),
    "mistral": ModelConfig(family="mistral", vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1,
                           sliding_window=5, max_seq_len=32),  # window shorter than the sequence
    "gpt2": ModelConfig(family="gpt2", vocab_size=96, d_model=32, n_layers=2, n_heads=4, max_seq_len=32),
    "qwen3_moe": ModelConfig(family="qwen3_moe", vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                             max_seq_len=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),  # q/k norms, experts
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_kv_cache_logits_equal_the_uncached_forward(family):
    cfg = FAMILIES[family]
    model = materialize(build(cfg), cfg, seed=3, device="cpu").eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
    cache = KVCache()
    parts = [forward_cached(model, ids[:, :7], cache)]  # a prompt, then one token at a time
    parts += [forward_cached(model, ids[:, t:t + 1], cache) for t in range(7, 20)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, **CACHE_FP32)


def _hf_greedy(hf_model, prompt: list[int], n: int, eos: int) -> list[int]:
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                            pad_token_id=eos, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    new = out[0, len(prompt):].tolist()
    return new[:new.index(eos) + 1] if eos in new else new


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_output_equals_transformers_greedy_generate(tmp_path, family):
    hf_dir = str(tmp_path / family)
    hf_model = save_tiny_hf(hf_configs()[family], hf_dir, seed=4)
    cfg = model_config_from_hf(hf_dir)
    model = load_hf_weights(build(cfg), hf_dir, cfg)
    for prompt in ([5, 17, 3], [9]):
        ours = generate_tokens(model, prompt, 24, temperature=0.0)
        assert len(ours) == 24 and ours == _hf_greedy(hf_model, prompt, 24, eos=-1)
        eos = ours[5]  # a token greedy decoding emits: both must stop right after it
        stopped = generate_tokens(model, prompt, 24, temperature=0.0, eos_id=eos)
        assert stopped == ours[:ours.index(eos) + 1] == _hf_greedy(hf_model, prompt, 24, eos=eos)


def test_sampling_is_seeded_and_top_k_1_or_a_tiny_top_p_is_greedy():
    cfg = FAMILIES["llama"]
    model = materialize(build(cfg), cfg, seed=3, device="cpu")
    greedy = generate_tokens(model, [1, 2, 3], 12)
    a = generate_tokens(model, [1, 2, 3], 12, temperature=1.0, seed=7)
    assert a == generate_tokens(model, [1, 2, 3], 12, temperature=1.0, seed=7)
    assert a != generate_tokens(model, [1, 2, 3], 12, temperature=1.0, seed=8)
    assert generate_tokens(model, [1, 2, 3], 12, temperature=1.0, top_k=1, seed=7) == greedy
    assert generate_tokens(model, [1, 2, 3], 12, temperature=1.0, top_p=1e-6, seed=7) == greedy
    assert len(generate_tokens(model, [1] * 30, 12)) == 2  # never past model.max_seq_len=32
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    picks = {choose_token(logits, 1.0, top_p=0.9, generator=torch.Generator().manual_seed(s)) for s in range(50)}
    assert picks == {1, 2}  # the nucleus: the two likely tokens, never the tail


def test_command_continues_a_prompt_from_a_hf_folder_as_transformers_does(tmp_path, capsys):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
    hf_dir = str(tmp_path / "llama")
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
    hf_model = save_tiny_hf(config, hf_dir, seed=2)
    tokenizer.save_pretrained(hf_dir)
    assert generate_main([hf_dir, "--prompt", "To be or not", "--max-new-tokens", "10"]) == 0
    prompt = tokenizer("To be or not")["input_ids"]
    expected = prompt + _hf_greedy(hf_model, prompt, 10, eos=tokenizer.eos_token_id)
    assert capsys.readouterr().out.strip() == tokenizer.decode(expected, skip_special_tokens=True).strip()


def test_command_reads_a_checkpoint_and_its_run_folder(capsys):
    out, _, _ = short_run()
    ckpt = os.path.join(out, "checkpoints", "step-00000006")
    model, tokenizer = load_for_generation(ckpt)
    prompt = tokenizer("ROMEO:")["input_ids"]
    expected = tokenizer.decode(prompt + generate_tokens(model, prompt, 12, eos_id=tokenizer.eos_token_id),
                                skip_special_tokens=True)
    for path in (ckpt, out):  # a run folder means its newest checkpoint
        assert generate_main([path, "--prompt", "ROMEO:", "--max-new-tokens", "12"]) == 0
        assert capsys.readouterr().out.strip() == expected.strip()
    assert generate_main([ckpt, "--prompt", "ROMEO:", "--temperature", "0.9", "--top-p", "0.9", "--seed", "3"]) == 0


def _one_error_line(capsys, argv) -> str:
    assert generate_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: generate"), err
    return err[0]


def test_corrupt_checkpoint_and_bad_arguments_exit_2_with_one_line(tmp_path, capsys):
    out, _, _ = short_run()
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(out, "checkpoints", "step-00000006"), ckpt)
    weights = os.path.join(ckpt, "rank-00000.safetensors")
    data = bytearray(open(weights, "rb").read())
    data[-100] ^= 0xFF
    open(weights, "wb").write(bytes(data))
    assert generate_main([ckpt, "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "corrupt" in err[0], err
    assert "neither manifest.json" in _one_error_line(capsys, [str(tmp_path), "--prompt", "x"])
    for bad in ("-1", "nan", "inf"):
        assert "--temperature must be a finite number >= 0" in _one_error_line(
            capsys, [out, "--prompt", "x", "--temperature", bad])
    undecodable = b"caf\xe9".decode("utf-8", "surrogateescape")  # what argv holds for Latin-1 bytes
    assert "--prompt is not valid UTF-8" in _one_error_line(capsys, [out, "--prompt", undecodable])
    assert "--top-p must be in (0, 1]" in _one_error_line(capsys, [out, "--prompt", "x", "--top-p", "0"])
    assert "--seed must be in [0, 2**63)" in _one_error_line(capsys, [out, "--prompt", "x", "--seed", str(2 ** 64)])
    assert "--device 'foo' is not a device name" in _one_error_line(capsys, [out, "--prompt", "x", "--device", "foo"])
    assert "only cpu and cuda" in _one_error_line(capsys, [out, "--prompt", "x", "--device", "meta"])
    if not torch.cuda.is_available():  # the CPU tests see no GPU, on a GPU machine too (tests/conftest.py)
        assert "no CUDA device is available here" in _one_error_line(capsys, [out, "--prompt", "x", "--device", "cuda"])
    missing = str(tmp_path / "no-tokenizer")  # the flag's folder is named, not the checkpoint's recipe
    assert f"--tokenizer {missing}: no such folder" in _one_error_line(capsys, [out, "--prompt", "x", "--tokenizer",
                                                                             missing])
    no_eos = tmp_path / "no-eos"  # a tokenizer the flag names is blamed on the flag, not on data.tokenizer
    no_eos.mkdir()
    (no_eos / "tokenizer.json").write_text("{}")
    assert _one_error_line(capsys, [out, "--prompt", "x", "--tokenizer", str(no_eos)]).startswith(
        "error: generate --tokenizer: cannot load")


@pytest.mark.slow
def test_a_multi_process_run_samples_on_rank_0_from_its_final_checkpoint(tmp_path):
    proc, _ = run_train(str(tmp_path), ["train.steps=2", "run.sample_tokens=8", "parallel.pp=2",
                                        "parallel.microbatches=2"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ckpt = os.path.join(str(tmp_path), "checkpoints", "step-00000002")
    assert proc.stdout.count(f"--- sample after 2 steps (from {ckpt}) ---") == 1, proc.stdout[-2000:]


def test_a_run_folder_means_its_own_newest_checkpoint_whatever_latest_says(tmp_path, capsys):
    """checkpoints/latest naming a folder elsewhere (an absolute path) made generate load that one; random bytes
    there were a decode error naming no file. The run folder's newest sealed step folder is read, as --resume auto
    picks it."""
    out, _, _ = short_run()
    run = tmp_path / "run"
    shutil.copytree(os.path.join(out, "checkpoints", "step-00000006"), run / "checkpoints" / "step-00000006")
    expected = None
    for latest in (b"/tmp/somewhere/else/step-00000009", b"\xc1\xff\x00garbage", None):
        if latest is None:
            os.remove(run / "checkpoints" / "latest")
        else:
            (run / "checkpoints" / "latest").write_bytes(latest)
        assert latest_checkpoint(str(run)) == str(run / "checkpoints" / "step-00000006")
        assert generate_main([str(run), "--prompt", "ROMEO:", "--max-new-tokens", "4"]) == 0
        text = capsys.readouterr().out
        assert expected is None or text == expected
        expected = text


def test_a_tiny_temperature_samples_the_argmax_not_nan():
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    for temperature in (1e-40, 1e-300):
        assert choose_token(logits, temperature, generator=torch.Generator().manual_seed(0)) == 1


def test_a_hf_config_too_large_to_hold_is_refused_before_a_layer_is_built(tmp_path, capsys):
    """num_hidden_layers 1e6 hung building the model; vocab_size 1e12 failed to allocate with a traceback."""
    import transformers
    for key, value in (("num_hidden_layers", 1_000_000), ("vocab_size", 10 ** 12)):
        hf_dir = tmp_path / key
        config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, max_position_embeddings=64)
        config.save_pretrained(hf_dir)
        cfg = json.loads((hf_dir / "config.json").read_text())
        cfg[key] = value
        (hf_dir / "config.json").write_text(json.dumps(cfg))
        line = _one_error_line(capsys, [str(hf_dir), "--prompt", "x"])
        assert "config.json describes" in line and "GB is available" in line, line


@pytest.mark.parametrize("temperature", ["0", "1"])
def test_weights_whose_logits_overflow_are_one_line_not_a_sampling_error(tmp_path, capsys, temperature):
    """A HF folder whose lm_head holds +-3e38 (finite: the NaN/inf check on loaded weights passes) gives inf
    logits: sampling raised RuntimeError from torch.multinomial with a traceback, greedy printed noise."""
    import transformers
    from safetensors.torch import load_file, save_file

    tokenizer = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
    hf_dir = str(tmp_path / "llama")
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
    save_tiny_hf(config, hf_dir, seed=2)
    tokenizer.save_pretrained(hf_dir)
    weights = os.path.join(hf_dir, "model.safetensors")
    state = load_file(weights)
    head = state["lm_head.weight"]
    state["lm_head.weight"] = torch.where(torch.rand(head.shape, generator=torch.Generator().manual_seed(0)) > 0.5,
                                          3e38, -3e38)
    save_file(state, weights, metadata={"format": "pt"})
    capsys.readouterr()  # save_pretrained's progress bar
    line = _one_error_line(capsys, [hf_dir, "--prompt", "To be", "--temperature", temperature])
    assert "next-token logits hold inf or NaN" in line, line
