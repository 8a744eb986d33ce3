"""train.py at parallel.ep=2 under torchrun: an MoE's losses, aux loss and expert loads in metrics.jsonl match
the single-process run's, its checkpoint reads back as one whole model (the end-of-run sample) and exports to
a transformers model with pipetrain's logits; an ep that does not divide the experts is one error line and
exit 2. (The router's aux-free bias under ep is checked against one process in tests/dist; an export refuses a
trained bias, tests/unit/test_moe_hf.py.)"""

import torch

from pipetrain.checkpoint.read import checkpoint_model_config, read_manifest
from pipetrain.generate.load import model_from_checkpoint
from tests.e2e.common import run_train, step_losses
from tests.harness import EXACT_FP32, run_script

MOE = ["model.family=qwen3_moe", "model.num_experts=4", "model.num_experts_per_tok=2",
       "model.moe_intermediate_size=64", "model.router_aux_loss_coef=0.01",
       "train.steps=4", "run.eval_every=0"]


def test_ep2_train_py_matches_single_process(tmp_path, token_cache):
    one, ref = run_train(str(tmp_path / "one"), MOE, cache_dir=token_cache)
    assert one.returncode == 0, one.stderr[-3000:]
    two, got = run_train(str(tmp_path / "two"), MOE + ["parallel.ep=2", "run.sample_tokens=4"], nproc=2,
                         cache_dir=token_cache)
    assert two.returncode == 0, two.stderr[-3000:]
    # the sample is drawn from a whole model read back from the ep run's checkpoint (global expert boxes)
    assert "--- sample after 4 steps (from " in two.stdout, two.stdout[-2000:]
    assert len(step_losses(got)) == len(step_losses(ref)) == 4
    for a, b in zip(step_losses(got), step_losses(ref)):
        assert abs(a - b) <= EXACT_FP32["rtol"] * abs(b) + EXACT_FP32["atol"], (a, b)
    steps = [m for m in got if "loss" in m]
    ref_steps = [m for m in ref if "loss" in m]
    for m, r in zip(steps, ref_steps):
        assert m["expert_load_max"] == r["expert_load_max"] and len(m["expert_load_max"]) == 4  # per layer
        assert abs(m["aux_loss"] - r["aux_loss"]) <= 1e-5 * r["aux_loss"]

    # Hugging Face export straight from the ep run's checkpoint (experts saved as boxes of the global tensors)
    from transformers import AutoModelForCausalLM  # deferred: heavy, only this part needs it

    ckpt = tmp_path / "two" / "checkpoints" / "step-00000004"
    res = run_script("pipetrain.hf", ["export", str(ckpt), str(tmp_path / "hf")])
    assert res.returncode == 0, res.stderr[-3000:]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    model, recipe = model_from_checkpoint(str(ckpt))  # the whole model, as generate reads it
    cfg = checkpoint_model_config(read_manifest(str(ckpt)))
    x = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), rtol=1e-5, atol=1e-5)


def test_ep_that_does_not_divide_the_experts_exits_2(tmp_path, token_cache):
    proc, _ = run_train(str(tmp_path), MOE + ["parallel.ep=3"], cache_dir=token_cache)
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert "parallel.ep: must divide model.num_experts=4" in line and "Traceback" not in proc.stderr
