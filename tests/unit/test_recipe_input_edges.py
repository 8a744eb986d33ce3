"""Recipe input at its edges (a fuzz of the CLI and recipe files): each is one `error:` line and exit 2, never a
traceback, a hang or a silent choice. Floats past float32's range (lr, DiLoCo's outer_lr overflowed the optimizer),
a slow factor that sleeps for years, an integer past Python's digit limit, a control character, an unreadable
recipe file, a key or section given twice (YAML kept the last silently), and a stop timeout the stop guard's
socket cannot take (its thread died, and with it every later signal)."""
import os

import pytest

from pipetrain import cli
from pipetrain.config import ConfigError, build_recipe, load_recipe
from pipetrain.parallel.mesh.rules import parallel_problems
from tests.unit.test_config import BASE, ROOT

TINY = os.path.join(ROOT, "recipes", "tiny.yaml")


@pytest.mark.parametrize("override, message", [
    ("train.lr=1e39", r"train.lr=1e\+39 is past float32's range \(3.403e\+38\)"),
    ("train.min_lr=-1e39", r"train.min_lr=-1e\+39 is past float32's range"),
    ("parallel.outer_lr=1e39", r"parallel.outer_lr=1e\+39 is past float32's range"),
    ("faults.slow_factor=1e12", r"faults.slow_factor: must be in \[1, 1000\]"),
    ("train.steps=" + "9" * 5000, r"--set train.steps: a value cannot be read \(Exceeds the limit"),
    ("train.steps=3\x01", r"--set 'train.steps=3\\x01': value is not a YAML scalar \(unacceptable character #x0001"),
])
def test_an_override_past_what_its_key_can_hold_is_one_line(override, message):
    with pytest.raises(ConfigError, match=message) as caught:
        build_recipe(BASE, [override], rules=parallel_problems)
    assert "\n" not in str(caught.value)


def test_a_float_at_float32s_edge_is_accepted():
    assert build_recipe(BASE, ["train.lr=3e38", "train.min_lr=0"]).train.lr == 3e38


@pytest.mark.parametrize("text, message", [
    ("train:\n  steps: 3\ntrain:\n  lr: 0.01\n", r"key 'train' is given twice at line 3"),
    ("train:\n  steps: 3\n  steps: 4\n", r"key 'steps' is given twice at line 3"),
    ("train:\n  steps: " + "9" * 5000 + "\n", r"a value cannot be read"),
    ("train:\n  steps: 3\x01\n", r"invalid YAML: unacceptable character #x0001"),
])
def test_a_recipe_file_with_a_duplicate_or_unreadable_value_is_one_line(tmp_path, text, message):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as caught:
        load_recipe(str(path))
    assert "\n" not in str(caught.value)


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="needs Linux's /proc/self/mem, which reads as EIO")
def test_a_recipe_file_that_cannot_be_read_is_one_line():
    with pytest.raises(ConfigError, match=r"recipe /proc/self/mem: cannot be read \(Input/output error\)"):
        load_recipe("/proc/self/mem")


def test_a_stop_timeout_the_guard_cannot_wait_is_refused_with_exit_2(capsys):
    code = cli.main(["--recipe", TINY, "--set", "run.stop_timeout_s=1e12", "--dry-run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "run.stop_timeout_s=1e+12 must be in (0, 86400]" in err[0]
