"""What pipetrain reads and runs from folders it is given (docs/checkpoints.md, guarantees):
never code from a tokenizer or model folder, never a file outside the model folder, and a damaged
safetensors header is one ConfigError, not a traceback."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest
import torch

from pipetrain.config import ConfigError, clip
from pipetrain.data import load_tokenizer
from pipetrain.hf.config import model_config_from_hf
from pipetrain.hf.weights import load_hf_weights
from pipetrain.models import build
from tests.harness import hf_configs, save_tiny_hf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "pipetrain", "assets", "tokenizer")
CUSTOM_CODE = 'open({marker!r}, "w").write("ran")\nfrom transformers import PreTrainedTokenizerFast\n' \
              "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"


def _tokenizer_folder(tmp_path, tokenizer_class: str) -> tuple[str, str]:
    """A tokenizer folder whose auto_map points at a Python file that leaves a marker when it runs."""
    folder, marker = tmp_path / "tok", str(tmp_path / "code-ran")
    folder.mkdir()
    shutil.copy(os.path.join(TOKENIZER, "tokenizer.json"), folder)
    (folder / "evil_tok.py").write_text(CUSTOM_CODE.format(marker=marker))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": tokenizer_class, "eos_token": "<|endoftext|>",
        "auto_map": {"AutoTokenizer": ["evil_tok.EvilTokenizer", None]}}))
    return str(folder), marker


def test_custom_tokenizer_code_never_runs_even_when_stdin_says_yes(tmp_path):
    folder, marker = _tokenizer_folder(tmp_path, "EvilTokenizer")
    # a fresh interpreter with "y" on stdin: transformers' prompt would take it as consent
    probe = ("from pipetrain.data import load_tokenizer\n"
             "try:\n    load_tokenizer(%r)\nexcept Exception as exc:\n    print(type(exc).__name__, exc)\n" % folder)
    out = subprocess.run([sys.executable, "-c", probe], input="y\ny\n", capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert not os.path.exists(marker), "the tokenizer folder's code ran"
    assert out.stdout.startswith("ConfigError") and "tokenizer_config.json" in out.stdout, out.stdout + out.stderr
    assert "auto_map" in out.stdout and len(out.stdout.strip().splitlines()) == 1


def test_auto_map_naming_a_shipped_class_still_loads_without_running_code(tmp_path):
    folder, marker = _tokenizer_folder(tmp_path, "PreTrainedTokenizerFast")  # as official folders do
    tok = load_tokenizer(folder)
    assert tok.eos_token_id == load_tokenizer(TOKENIZER).eos_token_id
    assert not os.path.exists(marker)


@pytest.fixture(scope="module")
def sharded_llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf") / "llama")
    save_tiny_hf(hf_configs()["llama"], path, max_shard_size="20KB")
    return path


def _with_index(src: str, dst, rewrite) -> str:
    shutil.copytree(src, dst)
    index = os.path.join(dst, "model.safetensors.index.json")
    with open(index) as f:
        data = json.load(f)
    data["weight_map"] = {k: rewrite(v) for k, v in data["weight_map"].items()}
    with open(index, "w") as f:
        json.dump(data, f)
    return str(dst)


def _load(hf_dir: str):
    cfg = model_config_from_hf(hf_dir)
    return load_hf_weights(build(cfg), hf_dir, cfg)


@pytest.mark.parametrize("how", ["absolute", "dotdot", "nested-dotdot"])
def test_an_index_cannot_point_weights_outside_the_model_folder(sharded_llama, tmp_path, how):
    outside = tmp_path / "outside"
    shutil.copytree(sharded_llama, outside)  # real weights there: a silent read would succeed
    rewrite = {"absolute": lambda v: str(outside / v), "dotdot": lambda v: f"../outside/{v}",
               "nested-dotdot": lambda v: f"sub/../../outside/{v}"}[how]
    folder = _with_index(sharded_llama, tmp_path / "model", rewrite)
    with pytest.raises(ConfigError, match="not a plain name inside the model folder"):
        _load(folder)


def test_an_index_through_links_inside_the_folder_still_loads(sharded_llama, tmp_path):
    """A Hugging Face cache snapshot (models--org--name/snapshots/<revision>/): its files are links into the
    repository's blobs folder; the index names the links."""
    repo = tmp_path / "models--org--llama"
    snapshot = repo / "snapshots" / "0123abc"
    shutil.copytree(sharded_llama, snapshot)
    blobs = repo / "blobs"
    blobs.mkdir()
    for name in os.listdir(snapshot):
        if name.endswith(".safetensors"):
            os.replace(snapshot / name, blobs / name)
            os.symlink(os.path.join("..", "..", "blobs", name), snapshot / name)
    ref = _load(sharded_llama)
    got = _load(str(snapshot))
    for (n, a), (_, b) in zip(ref.state_dict().items(), got.state_dict().items()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("header", [struct.pack("<Q", 1 << 63) + b"{}", struct.pack("<Q", 6) + b"{abc!}",
                                    b"\x01\x02"], ids=["length-2^63", "bad-json", "truncated"])
def test_a_damaged_safetensors_header_is_one_config_error(sharded_llama, tmp_path, header):
    folder = tmp_path / "model"
    shutil.copytree(sharded_llama, folder)
    first = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))[0]
    (folder / first).write_bytes(header)
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        _load(str(folder))


def test_clip_keeps_messages_short():
    assert clip("x" * 10) == "x" * 10
    long = clip("y" * 100_000)
    assert len(long) < 300 and long.startswith("y" * 200) and "99800 more" in long
