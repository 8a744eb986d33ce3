"""train.py end to end: metrics contract, learning, eval-only, and bad input exiting 2."""
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import yaml

from tests.e2e.common import ROOT, TINY, read_metrics, run_train, step_losses

STEP_KEYS = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_sec", "step_time_s", "peak_mem_bytes"}


def test_single_process_run_writes_metrics_and_learns(single_process_run):
    steps = [m for m in single_process_run if "loss" in m]
    evals = [m for m in single_process_run if "eval_loss" in m]
    assert [m["step"] for m in steps] == list(range(1, 21))
    for m in steps:
        assert STEP_KEYS <= set(m), set(m) ^ STEP_KEYS
        assert m["tokens"] == m["step"] * 8 * 32 and m["peak_mem_bytes"] > 0
    losses = step_losses(single_process_run)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 1.0, losses
    assert [e["step"] for e in evals] == [10, 20] and all(e["eval_tokens"] > 0 for e in evals)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]


def test_output_dir_holds_resolved_recipe(tmp_path, token_cache):
    proc, _ = run_train(str(tmp_path), ["train.steps=2", "run.eval_every=0"], cache_dir=token_cache)
    assert proc.returncode == 0, proc.stderr[-2000:]
    saved = yaml.safe_load(open(tmp_path / "recipe.yaml"))
    assert saved["train"]["steps"] == 2 and os.path.isabs(saved["data"]["path"])


def test_eval_only_writes_one_eval_line(tmp_path, token_cache):
    proc, metrics = run_train(str(tmp_path), extra_args=["--eval-only"], cache_dir=token_cache)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(metrics) == 1 and metrics[0]["step"] == 0 and metrics[0]["eval_loss"] > 8.0


def test_eval_only_adds_its_line_and_keeps_the_runs_metrics(tmp_path, token_cache):
    """--eval-only from an older checkpoint of a finished run, and in a folder with metrics but no checkpoint:
    one eval line is added and nothing else in metrics.jsonl changes (it cut the lines after the checkpoint,
    as a resumed training run does, and removed a checkpoint-less folder's file, as a fresh run does), nor
    the run's recipe.yaml (it wrote its own)."""
    run = ["train.steps=4", "checkpoint.every=2", "run.eval_every=0"]
    out = tmp_path / "run"
    proc, before = run_train(str(out), run, cache_dir=token_cache)
    assert proc.returncode == 0 and [m["step"] for m in before if "loss" in m] == [1, 2, 3, 4], proc.stderr[-2000:]
    older = ["--resume", str(out / "checkpoints" / "step-00000002"), "--eval-only"]
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    recipe = (out / "recipe.yaml").read_text()
    for folder, extra, step in ((out, older, 2), (bare, ["--eval-only"], 0)):
        kept = read_metrics(str(folder))
        proc, after = run_train(str(folder), run + ["run.eval_batches=1"], extra_args=extra, cache_dir=token_cache)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert after[:-1] == kept and after[-1]["step"] == step and "eval_loss" in after[-1], (folder, after)
    assert (out / "recipe.yaml").read_text() == recipe  # the run's recipe, not the evaluation's
    assert "eval_batches: 1" in (bare / "recipe.yaml").read_text()  # a folder without one gets the evaluation's


def test_sample_is_printed_at_the_end(tmp_path, token_cache):
    proc, _ = run_train(str(tmp_path), ["train.steps=2", "run.sample_tokens=8"], cache_dir=token_cache)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--- sample after 2 steps ---" in proc.stdout


def _bad(tmp_path, overrides, recipe=TINY):
    proc, _ = run_train(str(tmp_path), overrides, recipe=recipe)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_bad_input_exits_2_with_one_line(tmp_path):
    cases = [  # (overrides, recipe, what the one line says); the runs are independent: two at a time
        (["train.stepz=3"], TINY, ["unknown key 'train.stepz'", "did you mean 'steps'"]),
        (["train.steps=many"], TINY, ["train.steps='many' must be int"]),
        (["model.d_model=66"], TINY, ["model.d_model=66 must be divisible by model.n_heads=4"]),
        ([f"data.path={tmp_path}/missing"], TINY, ["data.path"]),
        ([f"data.tokenizer={tmp_path}/missing"], TINY, ["data.tokenizer"]),
        (["model.vocab_size=100"], TINY, ["vocab_size"]),
        ([], str(tmp_path / "nope.yaml"), ["not found"]),
    ]
    with ThreadPoolExecutor(max_workers=2) as pool:
        lines = list(pool.map(lambda i: _bad(tmp_path / f"case{i}", cases[i][0], recipe=cases[i][1]),
                              range(len(cases))))
    for (_, _, expected), line in zip(cases, lines):
        assert all(text in line for text in expected), (expected, line)


def _snapshot(out) -> dict:
    """Every file under a run directory with its bytes (the run lock's holder note aside)."""
    return {os.path.relpath(os.path.join(d, f), out): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(out) for f in files if f != ".pipetrain.lock"}


def test_a_bad_flag_exits_2_with_one_line_in_every_command():
    """argparse's own errors (an unknown flag, a missing argument) follow the bad-input rule too: one `error:`
    line that names the problem and where the options are, exit 2; argparse printed its usage block first."""
    commands = [[os.path.join(ROOT, "train.py"), "--recipe", "tiny", "--bogus"], [os.path.join(ROOT, "train.py")],
                ["-m", "pipetrain.data", "prepare"], ["-m", "pipetrain.plan", "--bogus"], ["-m", "pipetrain.generate"],
                ["-m", "pipetrain.checkpoint"], ["-m", "pipetrain.plot"], ["-m", "pipetrain.hf"],
                ["-m", "pipetrain.parallel.pipeline.schedules", "--pp", "2"]]

    def run(args):
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
    with ThreadPoolExecutor(2) as pool:
        for args, proc in zip(commands, pool.map(run, commands)):
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == 2 and len(lines) == 1, (args, proc.returncode, proc.stderr)
            assert lines[0].startswith("error: ") and "--help" in lines[0], (args, lines)


def test_the_same_command_again_resumes_its_run_and_another_recipe_is_refused(tmp_path, token_cache):
    """Run twice, as torchtitan and Megatron users do: a finished run reports its final metrics and exits 0
    without touching anything; a raised train.steps resumes from the newest checkpoint; a recipe that differs
    in any key but train.steps and run.* is refused with one line, leaving the saved run as it was."""
    base = ["train.steps=2", "run.eval_every=0"]
    first, metrics = run_train(str(tmp_path), base, cache_dir=token_cache)
    assert first.returncode == 0, first.stderr[-2000:]
    before = _snapshot(tmp_path)
    again, _ = run_train(str(tmp_path), base + ["run.log_every=5"], cache_dir=token_cache)
    assert again.returncode == 0, again.stderr[-2000:]
    last = [m for m in metrics if "loss" in m][-1]
    assert "already finished" in again.stdout and f"final loss {last['loss']:.4f} at step 2" in again.stdout
    assert _snapshot(tmp_path) == before
    # so does an explicit --resume auto: no checkpoint saved again, no second evaluation in metrics.jsonl
    resumed, _ = run_train(str(tmp_path), base + ["run.eval_every=1"], extra_args=["--resume", "auto"],
                           cache_dir=token_cache)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "nothing to train: the checkpoint resumed is at step 2 of train.steps=2" in resumed.stdout, resumed.stdout
    after = _snapshot(tmp_path)
    assert after.pop("recipe.yaml") != before["recipe.yaml"]  # the launch's recipe (run.eval_every=1) is recorded
    assert after == {k: v for k, v in before.items() if k != "recipe.yaml"}
    more, metrics = run_train(str(tmp_path), ["train.steps=3", "run.eval_every=0"], cache_dir=token_cache)
    assert more.returncode == 0, more.stderr[-2000:]
    assert "holds checkpoints of this recipe: resuming" in more.stdout and "at step 2" in more.stdout
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2, 3]
    before = _snapshot(tmp_path)
    message = _bad(tmp_path, ["train.steps=3", "run.eval_every=0", "train.lr=1e-2", f"data.cache_dir={token_cache}"])
    assert "already holds checkpoints of another recipe" in message and "train.lr: 0.003 there, 0.01 now" in message
    assert _snapshot(tmp_path) == before
    # refused later, by the checkpoint itself (--resume skips the recipe comparison): the folder's recipe.yaml
    # still resumes its run
    refused, _ = run_train(str(tmp_path), ["train.steps=3", "run.eval_every=0", "model.d_model=128"],
                           extra_args=["--resume", "auto"], cache_dir=token_cache)
    assert refused.returncode == 2 and "model.d_model" in refused.stderr, refused.stderr[-2000:]
    assert _snapshot(tmp_path) == before


def test_checkpoints_whose_manifest_does_not_read_are_never_overwritten(tmp_path):
    ckpt = tmp_path / "checkpoints" / "step-00000005"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text("{}")
    message = _bad(tmp_path, [])
    assert "already holds checkpoints, none of them readable" in message and "new folder" in message
    assert (ckpt / "manifest.json").read_text() == "{}"
    assert read_metrics(str(tmp_path)) == []


def test_diverged_loss_stops_with_the_step_and_saves_nothing(tmp_path, token_cache):
    # an absurd learning rate without clipping blows the weights up within a few steps
    proc, metrics = run_train(str(tmp_path), ["train.lr=1e30", "train.min_lr=0", "train.grad_clip=0",
                                              "train.warmup_steps=0", "checkpoint.every=1"], cache_dir=token_cache)
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(line) == 1 and "at step" in line[0] and "weights were not updated" in line[0]
    bad_step = int(line[0].split("at step ")[1].split(";")[0])
    assert all(m["step"] < bad_step for m in metrics)
    ckpts = os.listdir(tmp_path / "checkpoints") if (tmp_path / "checkpoints").exists() else []
    assert all(int(n.split("-")[1]) < bad_step for n in ckpts if n.startswith("step-"))
