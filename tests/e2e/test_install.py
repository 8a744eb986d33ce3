"""A built wheel, installed without -e into a fresh virtual environment outside the repository, runs.

The wheel is built from a clean copy of the sources (a stale build/ folder could hide a file the package
list leaves out), installed with pip into a new venv, and run from a folder outside the repository:
`pipetrain --help`, then two steps of the shipped `tiny` recipe by name, whose corpus and tokenizer come from
the installed package and whose output goes under the current directory, never inside the package.
"""
import glob
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig

import torch

from tests.e2e.common import ROOT, SMALL

# What the build reads (setup.py maps kernels/ and recipes/ into the package); nothing else is copied.
BUILD_INPUTS = ["pyproject.toml", "setup.py", "README.md", "pipetrain", "kernels", "recipes"]


def _version(dist: str) -> tuple:
    try:
        return tuple(int(x) for x in importlib.metadata.version(dist).split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return (0,)


def _build_wheel(src: str, out: str) -> str:
    """pip wheel of src into out; without build isolation where this interpreter can build a wheel itself
    (setuptools >= 70.1 has bdist_wheel built in; older ones need the wheel package), else isolated, which
    fetches setuptools from the package index."""
    can_build = _version("setuptools") >= (70, 1) or (
        _version("setuptools") >= (68,) and importlib.util.find_spec("wheel") is not None)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", out, src]
    if can_build:
        cmd.insert(4, "--no-build-isolation")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    wheels = glob.glob(os.path.join(out, "pipetrain-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _make_venv(path: str) -> str:
    """A new venv that sees this interpreter's third-party packages (torch, transformers, ...) through a .pth
    file, but no pipetrain: a path line in a .pth adds the folder without running that folder's own .pth
    files, so an editable install of the repository found there stays inactive. Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True, timeout=120)
    python = os.path.join(path, "bin", "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    dirs = [os.path.dirname(os.path.dirname(torch.__file__)), sysconfig.get_path("purelib")]
    dirs += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    # folders of packages on PYTHONPATH (a GPU machine's `datasets`, installed with pip --target), not one
    # that holds pipetrain itself (the repository root): _run drops PYTHONPATH
    dirs += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
             if p and not os.path.exists(os.path.join(p, "pipetrain"))]
    with open(os.path.join(purelib, "zz_host_packages.pth"), "w") as f:
        f.write("\n".join(dict.fromkeys(os.path.realpath(d) for d in dirs if os.path.isdir(d))) + "\n")
    return python


def _pip_install(python: str, wheel: str) -> None:
    # pip >= 22.3 installs into another interpreter (--python), which spares the venv its own pip
    if _version("pip") >= (22, 3):
        cmd = [sys.executable, "-m", "pip", "--python", python]
    else:
        subprocess.run([python, "-m", "ensurepip", "--default-pip"], check=True, capture_output=True, timeout=300)
        cmd = [python, "-m", "pip"]
    # no deps, no index, ignoring installs it can see: the dependencies come from the host's packages
    proc = subprocess.run(cmd + ["install", "--quiet", "--no-deps", "--no-index", "--ignore-installed", wheel],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def _run(cmd: list[str], cwd: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def _files_under(path: str) -> set:
    return {os.path.join(d, f) for d, _, files in os.walk(path) for f in files if "__pycache__" not in d}


def test_wheel_installed_outside_the_repository_runs_a_shipped_recipe(tmp_path, token_cache):
    src = tmp_path / "src"
    for name in BUILD_INPUTS:
        at = os.path.join(ROOT, name)
        if os.path.isdir(at):
            shutil.copytree(at, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            os.makedirs(src, exist_ok=True)
            shutil.copy2(at, src / name)
    wheel = _build_wheel(str(src), str(tmp_path / "wheel"))
    venv = str(tmp_path / "venv")
    python = _make_venv(venv)
    _pip_install(python, wheel)
    work = tmp_path / "work"  # outside the repository: the source tree is nowhere on sys.path
    work.mkdir()

    where = _run([python, "-c", "import os, pipetrain; print(os.path.dirname(pipetrain.__file__))"], str(work))
    assert where.returncode == 0, where.stderr[-3000:]
    package = where.stdout.strip()
    assert package.startswith(venv + os.sep) and not package.startswith(ROOT + os.sep), package

    script = os.path.join(venv, "bin", "pipetrain")
    help_ = _run([script, "--help"], str(work), timeout=300)
    assert help_.returncode == 0 and "--recipe" in help_.stdout, help_.stderr[-3000:]

    before = _files_under(package)
    sets = [s for s in SMALL if not s.startswith("train.steps=")] + [
        "train.steps=2", "run.eval_every=0", f"data.cache_dir={token_cache}"]
    proc = _run([script, "--recipe", "tiny", *[a for s in sets for a in ("--set", s)]], str(work))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with open(work / "runs" / "tiny" / "metrics.jsonl") as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]
    saved = (work / "runs" / "tiny" / "recipe.yaml").read_text()
    assert os.path.join(package, "assets", "shakespeare") in saved  # the shipped corpus, read where installed
    assert _files_under(package) == before  # nothing written inside the installed package

