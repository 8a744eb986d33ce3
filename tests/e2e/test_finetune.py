"""Fine-tuning a local Hugging Face model from train.py, and exporting the result back to HF."""
import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipetrain.checkpoint.read import checkpoint_model_config, iter_full_tensors
from pipetrain.config import DataConfig
from pipetrain.data import IGNORE_INDEX, Loader, build_data
from pipetrain.models import build, materialize
from tests.e2e.common import ROOT, run_train, save_tiny_hf_llama
from tests.harness import run_script

FINETUNE = os.path.join(ROOT, "recipes", "finetune-llama.yaml")
FT = ["run.sample_tokens=0", "run.progress=false", "run.log_every=1", "train.steps=3", "train.seq_len=32", "train.global_batch=4", "run.eval_batches=1", "run.eval_every=0",
      "data.val_fraction=0.2", "parallel.microbatches=1"]


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A tiny random llama saved like a hub download: config, weights and tokenizer."""
    out = tmp_path_factory.mktemp("hf-llama")
    save_tiny_hf_llama(out)
    return out


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft") / "train.jsonl"
    rows = [{"prompt": f"Who wrote play number {i}?\n", "completion": f" William Shakespeare wrote play {i}."}
            for i in range(60)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def _run(out, hf_model, sft_data, cache, extra=(), overrides=()):
    return run_train(str(out), FT + [f"model.init_from={hf_model}", f"data.path={sft_data}", "data.tokenizer=",
                                      "run.output_dir=" + str(out)] + list(overrides),
                     cache_dir=cache, extra_args=list(extra), recipe=FINETUNE, base=())


def test_eval_of_imported_model_equals_transformers_loss(tmp_path, hf_model, sft_data):
    proc, metrics = _run(tmp_path / "run", hf_model, sft_data, str(tmp_path / "cache"), extra=["--eval-only"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = metrics[0]["eval_loss"]
    # the same validation windows, scored by transformers
    tok = AutoTokenizer.from_pretrained(hf_model)
    cfg = DataConfig(path=str(sft_data), cache_dir=str(tmp_path / "cache"), val_fraction=0.2, seed=1234)
    batch = Loader(build_data(cfg, tok, 32), 4, 0, 1).val_batches(1)[0]
    ref = AutoModelForCausalLM.from_pretrained(hf_model, dtype=torch.float32)
    with torch.no_grad():
        logits = ref(batch.inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX)
    assert (batch.targets == IGNORE_INDEX).any(), "prompt tokens must be masked out of the loss"
    assert abs(ours - float(loss)) < 1e-5, (ours, float(loss))


def test_finetune_then_export_gives_transformers_the_same_logits(tmp_path, hf_model, sft_data):
    out = tmp_path / "run"
    proc, metrics = _run(out, hf_model, sft_data, str(tmp_path / "cache"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2, 3]
    ckpt = out / "checkpoints" / "step-00000003"
    export = tmp_path / "exported"
    res = run_script("pipetrain.hf", ["export", str(ckpt), str(export)])
    assert res.returncode == 0, res.stderr[-3000:]
    tuned = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(hf_model, dtype=torch.float32)
    x = torch.randint(0, 8192, (1, 16))
    with torch.no_grad():
        assert not torch.allclose(tuned(x).logits, base(x).logits), "fine-tuning changed nothing"
    # pipetrain's own model from the same checkpoint gives the same logits
    cfg = checkpoint_model_config(json.load(open(ckpt / "manifest.json")))
    model = materialize(build(cfg), cfg, 0, "cpu")
    with torch.no_grad():
        for name, tensor in iter_full_tensors(str(ckpt)):
            dict(model.named_parameters())[name].copy_(tensor)
        torch.testing.assert_close(tuned(x).logits, model(x), rtol=1e-5, atol=1e-5)
    assert os.path.exists(export / "tokenizer.json")


def test_recipe_contradicting_the_hf_config_exits_2(tmp_path, hf_model, sft_data):
    proc, _ = _run(tmp_path / "run", hf_model, sft_data, str(tmp_path / "cache"), overrides=["model.d_model=128"])
    assert proc.returncode == 2
    assert "model.d_model=128 contradicts" in proc.stderr
