"""Bad input found by an adversarial review (2026-11-28): each gave a traceback, a hang, a file written outside
the folder given, or a silently wrong run; each is now one line (ConfigError, exit 2) or handled."""
from __future__ import annotations

import json
import math
import os

import pytest

from pipetrain import cli
from pipetrain.plan.__main__ import main as plan_main
from pipetrain.build import _truncate_metrics
from pipetrain.checkpoint.read import step_of
from pipetrain.checkpoint.writer import _write_latest
from pipetrain.cli import _prepare_output_dir, launcher_int
from pipetrain.config import ConfigError, Recipe, RunConfig, dump_recipe
from pipetrain.config.loading import bounded_yaml
from pipetrain.data import open_prepared
from pipetrain.data.sources import source_files
from pipetrain.jsonfile import read_json
from pipetrain.run_lock import LOCK_NAME, RunLock
from tests.unit.common import LLAMA, build_trainer

DEEP = "[" * 100_000 + "]" * 100_000  # past what Python's json (and PyYAML's composer) can recurse into


def test_a_batch_with_no_trained_token_is_a_zero_step_not_a_division_by_zero(tmp_path):
    """Fine-tuning prompts longer than seq_len fill a batch with masked targets: float(loss_sum) / 0 stopped the
    run with a ZeroDivisionError, and every resume stopped on the same batch."""
    trainer = build_trainer(LLAMA, str(tmp_path), ignore_every=1, steps=2)  # every target masked
    before = [p.detach().clone() for p in trainer.model.parameters()]
    record = trainer.train_step()
    assert record["loss"] == 0.0 and math.isfinite(record["grad_norm"]) and record["grad_norm"] == 0.0, record
    # AdamW's first step on a zero gradient moves nothing but the weight decay
    assert all(float((p.detach() - b).abs().max()) <= 1e-2 * float(b.abs().max()) + 1e-12
               for p, b in zip(trainer.model.parameters(), before))


def test_deeply_nested_json_is_one_line(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text(DEEP)
    with pytest.raises(ConfigError, match=r"nests its JSON too deep to read; use another"):
        read_json(str(path), "checkpoint", ConfigError, "use another", 1 << 30)


def test_a_prepared_folder_with_a_deep_or_linked_manifest_is_one_line(tmp_path):
    folder = tmp_path / "prepared"
    folder.mkdir()
    (folder / "manifest.json").write_text(DEEP)
    with pytest.raises(ConfigError, match=r"manifest.json cannot be read \(RecursionError"):
        open_prepared(str(folder))
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    os.remove(folder / "manifest.json")
    os.symlink(outside, folder / "manifest.json")  # a folder handed over stands alone, its manifest too
    with pytest.raises(ConfigError, match=r"links outside the folder"):
        open_prepared(str(folder))


def test_a_recipe_nested_past_what_yaml_can_compose_is_one_line():
    with pytest.raises(ConfigError, match=r"nests past 32 levels"):
        bounded_yaml("run:\n  trackers: " + "[" * 1000 + "]" * 1000, "recipe r.yaml")


def test_a_link_back_up_a_data_folder_is_walked_once(tmp_path):
    """glob followed `loop -> .` until the path grew too long: one file read 41 times (validation documents
    copies of training ones); two such links never ended."""
    (tmp_path / "a.txt").write_text("text\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("more\n")
    for name in ("loop", "again"):
        os.symlink(".", tmp_path / name)
    os.symlink("..", tmp_path / "sub" / "up")
    assert source_files(str(tmp_path)) == ("text", [str(tmp_path / "a.txt"), str(tmp_path / "sub" / "b.txt")])
    os.symlink("/", tmp_path / "root")  # a folder link out is refused before anything under it is walked
    with pytest.raises(ConfigError, match=r"root links outside the folder"):
        source_files(str(tmp_path))


def test_links_in_the_output_folder_are_never_written_through(tmp_path):
    """The lock was opened through a link (the file it named emptied on release), recipe.yaml written through one."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "run"
    out.mkdir()
    os.symlink(victim, out / LOCK_NAME)
    with pytest.raises(ConfigError, match=rf"{LOCK_NAME} is a link; "):
        RunLock(str(out)).acquire()
    os.remove(out / LOCK_NAME)
    os.mkdir(out / LOCK_NAME)
    with pytest.raises(ConfigError, match=rf"{LOCK_NAME} cannot be opened \(Is a directory\)"):
        RunLock(str(out)).acquire()
    os.rmdir(out / LOCK_NAME)
    os.mkfifo(out / LOCK_NAME)
    with pytest.raises(ConfigError, match=rf"{LOCK_NAME} is not a regular file"):
        RunLock(str(out)).acquire()
    os.symlink(victim, out / "recipe.yaml")
    dump_recipe(Recipe(), str(out / "recipe.yaml"))
    assert victim.read_text() == "precious" and not os.path.islink(out / "recipe.yaml")
    assert [n for n in os.listdir(out) if ".tmp-" in n] == []


def test_the_temporary_files_of_latest_and_metrics_are_never_written_through(tmp_path):
    """checkpoints/.latest.tmp and metrics.jsonl.tmp left as links (to files outside the run folder) were opened
    through: a resumed run overwrote both targets, and the links became checkpoints/latest and metrics.jsonl."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    victims = [tmp_path / "a.txt", tmp_path / "b.txt"]
    for victim in victims:
        victim.write_text("precious")
    os.symlink(victims[0], run / "checkpoints" / ".latest.tmp")
    os.symlink(victims[1], run / "metrics.jsonl.tmp")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    _write_latest(str(run / "checkpoints"), "step-00000001")
    assert _truncate_metrics(str(run / "metrics.jsonl"), 1) == 1
    assert [v.read_text() for v in victims] == ["precious", "precious"]
    assert not os.path.islink(run / "checkpoints" / "latest") and not os.path.islink(run / "metrics.jsonl")
    assert (run / "checkpoints" / "latest").read_text() == "step-00000001\n"


def test_an_output_folder_inside_a_checkpoint_or_with_a_metrics_folder_is_refused(tmp_path):
    """A run written into checkpoints/step-N made that checkpoint unreadable, and re-saving the step deleted it."""
    step = tmp_path / "run" / "checkpoints" / "step-00000002"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{}")
    for out in (step, step / "nested"):
        recipe = Recipe(run=RunConfig(output_dir=str(out)))
        with pytest.raises(ConfigError, match=r"is inside the checkpoint .*step-00000002 \(a step folder"):
            _prepare_output_dir(recipe, 0, None)
    assert sorted(os.listdir(step)) == ["manifest.json"]
    other = tmp_path / "other"
    (other / "metrics.jsonl").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"metrics.jsonl is a folder where the metrics file goes"):
        _prepare_output_dir(Recipe(run=RunConfig(output_dir=str(other))), 0, None)


@pytest.mark.parametrize("kind", ["pipe", "link"])
def test_a_metrics_file_that_is_a_pipe_or_a_link_is_refused_where_a_run_keeps_it(tmp_path, kind):
    """--resume auto read a pipe named metrics.jsonl forever (a hang); --eval-only appended its line through a link
    to a file outside the run folder. A fresh run removes whatever is there, as before."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "run"
    out.mkdir()
    metrics = out / "metrics.jsonl"
    recipe = Recipe(run=RunConfig(output_dir=str(out)))
    for resume, eval_only in (("auto", False), (None, True)):
        os.mkfifo(metrics) if kind == "pipe" else os.symlink(victim, metrics)
        with pytest.raises(ConfigError, match=rf"metrics.jsonl is {'a link' if kind == 'link' else 'not a regular'}"):
            _prepare_output_dir(recipe, 0, resume, eval_only)
        os.remove(metrics)
    os.mkfifo(metrics) if kind == "pipe" else os.symlink(victim, metrics)
    _prepare_output_dir(recipe, 0, None).release()
    assert not os.path.lexists(metrics) and victim.read_text() == "precious"


def test_an_error_is_one_line_whatever_it_quotes():
    """A file name holding a newline split the error line in two."""
    assert str(ConfigError("data.path: /d/bad\nname.txt is not UTF-8")) == "data.path: /d/bad\\nname.txt is not UTF-8"


@pytest.mark.parametrize("value", ["abc", "0", "-1", " ", "\u00b2"])  # a superscript 2: isdigit() but not int()
def test_a_malformed_launcher_variable_is_one_line(monkeypatch, value):
    monkeypatch.setenv("WORLD_SIZE", value)
    with pytest.raises(ConfigError, match=rf"WORLD_SIZE={value!r}: must be a whole number >= 1"):
        launcher_int("WORLD_SIZE", 1, minimum=1)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launcher_int("WORLD_SIZE", 1, minimum=1) == 4
    monkeypatch.delenv("WORLD_SIZE")
    assert launcher_int("WORLD_SIZE", 1, minimum=1) == 1


@pytest.mark.parametrize("value", ["\u00b2", str(10 ** 20), "0"])
def test_a_malformed_collective_timeout_is_one_line(monkeypatch, value):
    """A superscript digit was a ValueError from int(), 1e20 minutes an OverflowError from timedelta: tracebacks
    before the process group started."""
    monkeypatch.setenv("PIPETRAIN_TIMEOUT_MIN", value)
    monkeypatch.setattr(cli.dist, "is_initialized", lambda: False)
    with pytest.raises(ConfigError, match=r"PIPETRAIN_TIMEOUT_MIN=.*: must be a whole number of minutes in \[1, "):
        cli._init_distributed(2)


def test_an_unknown_kernel_mode_is_one_line_before_a_run_is_built(monkeypatch, capsys, tmp_path):
    """train.py exited 1 with the ValueError of kernels/dispatch.py and its traceback (the memory check reads it)."""
    monkeypatch.setenv("PIPETRAIN_KERNELS", "bogus")
    assert cli.main(["--recipe", "tiny", "--dry-run", "--set", f"run.output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: PIPETRAIN_KERNELS='bogus' is not one of auto, torch, triton; unset it for auto"], err


def test_the_planner_names_an_unknown_kernel_mode_alone(monkeypatch, capsys):
    """python -m pipetrain.plan refused every candidate with it, in a line saying that no layout keeps the fixed
    keys and to drop one or launch another world size."""
    monkeypatch.setenv("PIPETRAIN_KERNELS", "bogus")
    assert plan_main(["--recipe", "tiny", "--nproc", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: PIPETRAIN_KERNELS='bogus' is not one of auto, torch, triton; unset it for auto"], err


def test_a_step_folder_named_with_a_superscript_is_no_step():
    """A stray checkpoints/step-\u00b2 folder crashed a resumed run at its first save (ValueError from int() while
    rotating old checkpoints), after the steps it had trained."""
    assert step_of("/run/checkpoints/step-\u00b2") == -1 and step_of("/run/checkpoints/step-00000012") == 12


def test_a_manifest_json_value_survives_the_round_trip(tmp_path):
    """read_json still reads what it should (a shallow document)."""
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"a": [[1]]}))
    assert read_json(str(path), "x", ConfigError, "fix", 1000) == {"a": [[1]]}


def test_a_cache_dir_that_is_a_file_is_named_as_the_cache(tmp_path):
    """It was blamed on data.path ("could not be read as text ... fix or remove the damaged file")."""
    from pipetrain.data import load_tokenizer, prepare
    from tests.unit.test_data import TOKENIZER
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("some text\n")
    (tmp_path / "cache").write_text("a file")
    with pytest.raises(ConfigError, match=r"data.cache_dir=.*cache' cannot be used \(Not a directory.*point "
                                          r"data.cache_dir at a folder you can write"):
        prepare(str(tmp_path / "data"), load_tokenizer(TOKENIZER), cache_dir=str(tmp_path / "cache"), progress=False)


def test_a_token_id_past_the_tokenizer_is_one_line_even_without_verify(tmp_path):
    """With data.verify=false (and on every rank but the one that prepares) nothing read the token file whole at
    start: an id past the vocabulary, from a file damaged after prepare, indexed past the embedding (IndexError on
    the CPU, a device-side assert on CUDA). Each batch is checked as it is read."""
    import numpy as np
    from pipetrain.config import DataConfig
    from pipetrain.data import build_data, load_tokenizer, prepare
    from tests.unit.test_data import TOKENIZER
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.txt").write_text("To be, or not to be, that is the question.\n" * 40)
    tokenizer = load_tokenizer(TOKENIZER)
    out = prepare(str(tmp_path / "raw"), tokenizer, cache_dir=str(tmp_path / "cache"), progress=False)
    cfg = DataConfig(path=out, tokenizer=TOKENIZER, val_fraction=0.0, verify=False)
    data = build_data(cfg, tokenizer, 16)
    data.train_batch(0, data.num_train_windows)  # intact: every window reads
    tokens = np.memmap(os.path.join(out, "tokens.bin"), dtype=data.tokens.dtype, mode="r+")
    tokens[len(tokens) // 2] = len(tokenizer)  # one id past the vocabulary, after prepare
    tokens.flush()
    data = build_data(cfg, tokenizer, 16)  # opens without reading the tokens (verify=false)
    with pytest.raises(ConfigError, match=rf"tokens.bin holds token id {len(tokenizer)}, past the tokenizer's "
                                          rf"{len(tokenizer)} tokens.*prepare again"):
        data.train_batch(0, data.num_train_windows)


def test_a_manifest_whose_recipe_does_not_build_its_tensors_is_refused_by_every_reader(tmp_path):
    """A sealed manifest whose recipe.model disagrees with its tensors (vocab_size 1e12 beside 64-row tensors):
    generate tried to allocate the recipe's model (a traceback), export wrote part of a folder and stopped on
    "File too large", and consolidate wrote a pipetrain_model.json naming the recipe's shapes."""
    from pipetrain.checkpoint.manifest import CHECKSUM_KEY, seal
    from pipetrain.checkpoint.read import read_manifest
    from pipetrain.checkpoint.tools import consolidate
    from pipetrain.generate.load import model_from_checkpoint
    from pipetrain.hf.export import export_checkpoint
    (tmp_path / "run").mkdir()
    trainer = build_trainer(LLAMA, str(tmp_path / "run"), steps=1)
    trainer.train_step()
    ckpt = trainer.checkpointer.save(trainer)
    trainer.checkpointer.wait()
    read_manifest(ckpt)  # intact: it builds
    with open(os.path.join(ckpt, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["recipe"]["model"]["vocab_size"] = 10 ** 12
    manifest.pop(CHECKSUM_KEY)
    with open(os.path.join(ckpt, "manifest.json"), "w") as f:
        json.dump(seal(manifest), f)
    message = r"recipe.model does not build the model its tensors are \(model/embed.weight is \[64, 32\], the recipe"
    for read in (read_manifest, model_from_checkpoint, lambda c: consolidate(c, str(tmp_path / "out")),
                 lambda c: export_checkpoint(c, str(tmp_path / "hf"))):
        with pytest.raises(ConfigError, match=message):
            read(ckpt)
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "hf")


def test_messages_name_the_input_at_fault(tmp_path, capsys):
    """A review found two lines blaming the wrong input: a fresh run of train.steps=0 said "the checkpoint
    resumed is at step 0", and `export --tokenizer DIR` of a missing DIR blamed the checkpoint's recipe."""
    from pipetrain.hf.export import export_checkpoint
    (tmp_path / "run").mkdir()
    trainer = build_trainer(LLAMA, str(tmp_path / "run"), steps=0)
    trainer.fit()
    assert "nothing to train: train.steps=0; set train.steps" in capsys.readouterr().out
    (tmp_path / "run2").mkdir()
    trainer = build_trainer(LLAMA, str(tmp_path / "run2"), steps=1)
    trainer.train_step()
    ckpt = trainer.checkpointer.save(trainer)
    trainer.checkpointer.wait()
    with pytest.raises(ConfigError, match=r"export: --tokenizer was not found, got '.*nowhere'; pass --tokenizer"):
        export_checkpoint(ckpt, str(tmp_path / "hf"), tokenizer_dir=str(tmp_path / "nowhere"))
