#!/usr/bin/env bash
# Before a GPU session, here (where pip reaches a package index): the wheels benchmarks/gpu_session.sh
# installs on the GPU machine, which has no `datasets` and no network. Writes .whl/ in the repository root
# (.gitignore leaves it out of git), to be carried with the device call (carry: [".whl"]):
#   .whl/            datasets and the two packages it needs that the machine lacks (dill, multiprocess),
#                    at the versions this environment has installed;
#   .whl/fallback/   pyarrow and fsspec, installed there only where the machine's own are too old for
#                    that datasets (about 50 MB of the 64 MiB a call may carry).
# The machine runs CPython 3.12 on x86-64 (the device tool's KINDS.md).
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
get() {  # get FOLDER PACKAGE...: binary wheels for CPython 3.12 on manylinux x86-64, without their needs
  local dir=$1
  shift
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" "$@"
}
get .whl "datasets==$(version datasets)" "dill==$(version dill)" "multiprocess==$(version multiprocess)"
get .whl/fallback "pyarrow==$(version pyarrow)" "fsspec==$(version fsspec)"
du -sh .whl
