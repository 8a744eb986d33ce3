"""Seeded fuzzing of the two inputs a user hands pipetrain most: recipes and Hugging Face model folders.

Every case ends in success or in one ConfigError line (short, no newline), never another exception, a
hang or a read outside the folder it was given. An audit hook on `open` proves the last: bait files sit
beside each case folder and any open of one fails the case. Each family also holds valid inputs that
must succeed, so a loader that refused everything would fail too."""
from __future__ import annotations

import copy
import json
import os
import random
import shutil
import struct
import sys

import pytest
import yaml

from pipetrain import cli
from pipetrain.config import ConfigError, load_recipe
from pipetrain.hf.config import model_config_from_hf
from pipetrain.hf.weights import load_hf_weights
from pipetrain.models import build
from pipetrain.parallel.mesh.rules import layout_problems, parallel_problems
from pipetrain.preflight import check_model_fits
from tests.harness import hf_configs, save_tiny_hf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "recipes", "tiny.yaml")
MAX_LINE = 2000  # an error line quotes values clipped to 200 characters; lists of problems stay short

WEIRD = [None, True, -1, 0, 1, 3, 2 ** 63, -(2 ** 70), 1e308, float("inf"), float("nan"), "", "x" * 5000,
         "8", "../../etc/passwd", "/etc/passwd", [], [1, [2, [3]]], {}, {"a": {"b": None}}, 0.5, "!!python/object"]


class OpenAudit:
    """Fails the test when a file under a bait folder is opened for reading (installed once: audit hooks
    stay for the life of the interpreter; the test's own copies into the bait folder are writes)."""
    bait: list[str] = []
    hits: list[str] = []

    @classmethod
    def install(cls):
        if getattr(sys, "_pipetrain_open_audit", False):
            return
        sys._pipetrain_open_audit = True

        def hook(event, args):
            if event != "open" or not cls.bait or len(args) < 3:  # open's arguments: (path, mode, flags)
                return
            reading = isinstance(args[2], int) and not args[2] & (os.O_WRONLY | os.O_RDWR)
            if reading and isinstance(args[0], (str, bytes, os.PathLike)):
                path = os.path.abspath(os.fsdecode(args[0]))
                if any(path.startswith(b) for b in cls.bait):
                    cls.hits.append(path)
        sys.addaudithook(hook)


@pytest.fixture
def audit(tmp_path):
    OpenAudit.install()
    bait = tmp_path / "bait"
    bait.mkdir()
    OpenAudit.bait, OpenAudit.hits = [str(bait)], []
    yield bait
    OpenAudit.bait = []
    assert not OpenAudit.hits, f"read outside the folder it was given: {OpenAudit.hits[:3]}"


def _outcome(fn) -> str:
    """"ok" or "error"; anything but a ConfigError of one short line fails the test."""
    try:
        fn()
        return "ok"
    except ConfigError as exc:
        text = str(exc)
        assert "\n" not in text and len(text) < MAX_LINE, f"not one short line: {text[:300]!r}"
        return "error"


# ---- recipes ----

def _mutate_recipe(rng: random.Random, base: dict) -> dict | str:
    raw = copy.deepcopy(base)
    kind = rng.randrange(7)
    sections = list(raw)
    section = rng.choice(sections)
    key = rng.choice(list(raw[section]))
    if kind == 0:  # a wrong type or extreme value for a known key
        raw[section][key] = rng.choice(WEIRD)
    elif kind == 1:  # a plausible value (valid or not)
        raw[section][key] = rng.choice([1, 2, 4, 8, 16, 0, 64, 7])
    elif kind == 2:  # unknown keys and sections
        raw[rng.choice([section, "nonsense"])] = {"k": 1} if rng.random() < 0.5 else 5
    elif kind == 3:  # a section replaced by a scalar or a list
        raw[section] = rng.choice([None, 3, "text", [1, 2]])
    elif kind == 4:  # deep nesting under a known key
        value = "leaf"
        for _ in range(rng.randrange(1, 50)):
            value = [value] if rng.random() < 0.5 else {"k": value}
        raw[section][key] = value
    elif kind == 5:  # several keys at once
        for _ in range(3):
            s = rng.choice(sections)
            raw[s][rng.choice(list(raw[s]))] = rng.choice(WEIRD + [1, 2, 4])
    else:  # YAML text with aliases, as a file would have them
        depth = rng.randrange(1, 9)
        lines = ["run:", "  trackers:", '    - &a0 ["x", "x", "x", "x", "x", "x", "x", "x"]']
        for i in range(1, depth):
            lines.append(f"    - &a{i} [{', '.join([f'*a{i - 1}'] * 8)}]")
        return yaml.safe_dump({k: v for k, v in raw.items() if k != "run"}) + "\n".join(lines) + "\n"
    return raw


def _recipe_case(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
    recipe = load_recipe(path, rules=parallel_problems)  # as the CLI loads it
    for world in (1, 2, 4):
        if not layout_problems(recipe, world):
            check_model_fits(recipe, world)


def test_recipe_fuzz_ends_in_success_or_one_config_error_line(tmp_path, audit):
    with open(TINY) as f:
        base = yaml.safe_load(f)
    base["data"].update(path=str(audit / "corpus"), tokenizer=str(audit / "tokenizer"))  # named, never read
    rng = random.Random(1234)
    outcomes = {"ok": 0, "error": 0}
    for i in range(240):
        case = _mutate_recipe(rng, base) if i % 6 else copy.deepcopy(base)  # every 6th case is valid
        text = case if isinstance(case, str) else yaml.safe_dump(case)
        outcome = _outcome(lambda: _recipe_case(str(tmp_path / f"r{i}.yaml"), text))
        if not isinstance(case, str) and case == base:
            assert outcome == "ok", f"case {i}: the valid recipe was refused"
        outcomes[outcome] += 1
    assert outcomes["ok"] >= 40 and outcomes["error"] >= 100, outcomes


def test_recipe_fuzz_through_the_command_line_exits_0_or_2_with_one_line(tmp_path, capsys):
    """A handful of the same cases through train.py's entry point (--dry-run: nothing is trained)."""
    with open(TINY) as f:
        base = yaml.safe_load(f)
    base["data"].update(path=str(tmp_path / "corpus"), tokenizer=str(tmp_path / "tokenizer"))
    rng = random.Random(7)
    codes = []
    for i in range(12):
        case = _mutate_recipe(rng, base) if i else copy.deepcopy(base)
        path = tmp_path / f"r{i}.yaml"
        path.write_text(case if isinstance(case, str) else yaml.safe_dump(case))
        code = cli.main(["--recipe", str(path), "--dry-run", "--nproc", "2"])
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert code in (0, 2), (i, code, err)
        assert (code == 0 and not err) or (code == 2 and len(err) == 1 and err[0].startswith("error: ")), (i, err)
        codes.append(code)
    assert codes[0] == 0 and codes.count(2) >= 6, codes


# ---- Hugging Face model folders ----

@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf") / "llama")
    save_tiny_hf(hf_configs()["llama"], path, max_shard_size="20KB")
    return path


def _mutate_folder(rng: random.Random, folder: str, bait: str) -> None:
    config_path, index_path = os.path.join(folder, "config.json"), os.path.join(folder, "model.safetensors.index.json")
    kind = rng.randrange(5)
    if kind in (0, 1):  # config.json fields
        with open(config_path) as f:
            config = json.load(f)
        for _ in range(rng.randrange(1, 4)):
            key = rng.choice(list(config) + ["num_hidden_layers", "hidden_size", "vocab_size", "rope_scaling"])
            config[key] = rng.choice(WEIRD + [1000000, 2, 64, 3])
        with open(config_path, "w") as f:
            f.write(json.dumps(config) if rng.random() < 0.9 else json.dumps(config)[:-7])
    elif kind == 2:  # the index's weight map
        with open(index_path) as f:
            index = json.load(f)
        names = list(index["weight_map"])
        choice = rng.randrange(4)
        if choice == 0:
            index["weight_map"][rng.choice(names)] = rng.choice(
                [os.path.join(bait, "model.safetensors"), "../bait/model.safetensors", "a/../../bait/x", "", 5, None])
        elif choice == 1:
            index["weight_map"] = rng.choice([[], "x", None, {"a": {"b": 1}}])
        elif choice == 2:
            del index["weight_map"][rng.choice(names)]
        else:
            index = rng.choice([[], "x", {"metadata": {}}])
        with open(index_path, "w") as f:
            json.dump(index, f)
    elif kind == 3:  # a shard's header
        shard = os.path.join(folder, rng.choice(sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))))
        with open(shard, "rb") as f:
            data = bytearray(f.read())
        choice = rng.randrange(3)
        if choice == 0:
            data[:8] = struct.pack("<Q", rng.choice([0, 1, 2 ** 63, len(data) * 2, 2 ** 64 - 1]))
        elif choice == 1:
            n = struct.unpack("<Q", bytes(data[:8]))[0]
            for _ in range(5):
                data[8 + rng.randrange(n)] = rng.randrange(256)
        else:
            data = data[:rng.randrange(len(data))]
        with open(shard, "wb") as f:
            f.write(bytes(data))
    else:
        os.remove(rng.choice([config_path, index_path]))


def _hf_case(folder: str) -> None:
    cfg = model_config_from_hf(folder)
    if cfg.n_layers * cfg.d_model * cfg.vocab_size <= 10 ** 8:  # a model this test can afford to build
        load_hf_weights(build(cfg), folder, cfg)


def test_hf_folder_fuzz_ends_in_success_or_one_config_error_line(llama_folder, tmp_path, audit):
    shutil.copytree(llama_folder, audit / "model-outside")  # real weights outside: a silent read would work
    shutil.copy(os.path.join(llama_folder, sorted(f for f in os.listdir(llama_folder)
                                                  if f.endswith(".safetensors"))[0]), audit / "model.safetensors")
    rng = random.Random(99)
    outcomes = {"ok": 0, "error": 0}
    for i in range(200):
        folder = str(tmp_path / f"m{i}")
        shutil.copytree(llama_folder, folder)
        if i % 5:  # every 5th case is the folder as saved, which must load
            _mutate_folder(rng, folder, str(audit))
        outcome = _outcome(lambda: _hf_case(folder))
        if i % 5 == 0:
            assert outcome == "ok", f"case {i}: the saved folder was refused"
        outcomes[outcome] += 1
        shutil.rmtree(folder)
    assert outcomes["ok"] >= 40 and outcomes["error"] >= 80, outcomes
