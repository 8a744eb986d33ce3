#!/usr/bin/env bash
# Everything one lent GPU is for, in one command that fits the device tool's 10-minute call:
#
#   bash benchmarks/gpu_session.sh            (from the repository root, on the GPU machine)
#   bash benchmarks/gpu_session.sh suite      the rest of the suite there instead (tests/dist, tests/e2e)
#   bash benchmarks/gpu_session.sh check      five minutes: issue 34's rows with their profiles, then `pytest -m gpu`
#
# The machine has torch, Triton and transformers but no network and no `datasets`: nothing here downloads
# or prepares a corpus (benchmarks/gpu.py uses synthetic tokens). pipetrain is installed in place without
# dependencies; where pip cannot build it offline, a pipetrain/kernels link stands in for the install
# mapping kernels/ -> pipetrain.kernels (setup.py).
#
# Writes under $OUT (the device tool's return folder; ./gpu-out elsewhere):
#   card.txt              nvidia-smi's name and memory, and torch / Triton versions
#   gpu-benchmark.md      benchmarks/gpu.py's tables (issue 34: compile, fp8, fused loss, the kernel table)
#   gpu.log               its console output
#   pytest-gpu.log        `pytest -m gpu`: the CUDA paths (Triton compiled, bf16, fp8, compile)
#   pytest-cpu.log        tests/unit and tests/kernels on the CUDA machine, where they must see no GPU
#                         (tests/conftest.py): one test a line, so a cut-short run still names its failures
#   moe.log               benchmarks/moe.py experts: torch._grouped_mm against the per-expert loop
# Each step has its own timeout so a slow one cannot starve the rest: 340 + 170 + 40 s, plus at most 30 s
# of install, inside one 600 s call. gpu.py rewrites its file after every row, target rows first, so if it
# overruns its 340 s only the last rows are lost (the issue asks for under 5 minutes; the first run on a
# card says whether it is). The two test runs share their 170 s: they time nothing, and the CPU one never
# touches the GPU; the timed steps (gpu.py, moe.py) run alone. On 2 cores tests/kernels and tests/unit take
# about 150 s alone, so the CPU run may be cut short: kernels go first, and every test gets a line.
# The rest of the suite on the CUDA machine (tests/dist and tests/e2e, about 13 minutes on 2 cores) needs
# a call of its own: the `suite` argument runs the two folders side by side, 540 s each, writing
# pytest-dist.log and pytest-e2e.log.
# Multi-GPU comparisons (zero 3 against FSDP2, cp against torch's context_parallel) need several cards:
# one card cannot run them (multi-process tests never put two ranks on one GPU).
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
} > "$OUT/card.txt" 2>&1

# `datasets` is not on the machine and tests prepare corpora with it: its wheels travel in .whl (carry:
# [".whl"]), made before the call, where pip reaches an index, by `bash benchmarks/gpu_wheels.sh`; pyarrow
# and fsspec in .whl/fallback are used only where the machine's own are too old for that datasets.
# Installed apart (--target), first on PYTHONPATH.
if [ -d .whl ]; then
  python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >> "$OUT/install.log" 2>&1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  if ! python -c "import datasets" >> "$OUT/install.log" 2>&1 && [ -d .whl/fallback ]; then
    python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/fallback/*.whl >> "$OUT/install.log" 2>&1
  fi
  python -c "import datasets; print('datasets', datasets.__version__)" >> "$OUT/install.log" 2>&1
fi

# `python -m pip`: a bare `pip` there may belong to another interpreter. The install counts only if
# pipetrain.kernels then imports (an old setuptools makes an editable install without the kernels/ mapping).
timeout 30 python -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1
if ! python -c "import pipetrain.kernels" >> "$OUT/install.log" 2>&1; then
  python -c "import setuptools; print('setuptools', setuptools.__version__)" >> "$OUT/install.log" 2>&1
  ln -sfn ../kernels pipetrain/kernels
  echo "pipetrain.kernels did not import after the install; pipetrain/kernels linked instead" >> "$OUT/install.log"
  python -c "import pipetrain.kernels" >> "$OUT/install.log" 2>&1 || echo "still not importable" >> "$OUT/install.log"
fi

step() {  # step SECONDS LOG COMMAND...: run with a timeout, record the exit status in the log
  local limit=$1 log=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$log" 2>&1
  printf "\nexit %s after %s s: %s\n" "$?" "$((SECONDS - start))" "$*" >> "$OUT/$log"
  tail -n 1 "$OUT/$log"
}

PYTEST=(python -m pytest -v -rfE --tb=short -p no:cacheprovider)  # -v: a cut-short run still names its failures
if [ "${1:-}" = check ]; then  # what a session with about 5 minutes of device time left can still do
  # the target rows again with their profiles and longest kernels, the plain loop's compile beside them
  step 135 gpu.log python benchmarks/gpu.py --out "$OUT/gpu-benchmark.md" --no-kernel-table \
    --only "pipetrain Trainer (Triton kernels)" --only "pipetrain, train.compile=true" \
    --only "torch.compile of the plain loop" --only "pipetrain, train.precision=fp8 + train.compile=true" \
    --only "pipetrain, train.precision=fp8 + train.compile=true + PIPETRAIN_KERNELS=torch"
  step 95 pytest-gpu.log "${PYTEST[@]}" -m gpu --basetemp=/tmp/pt-gpu
  exit 0
fi
if [ "${1:-}" = suite ]; then  # a session of its own: the multi-process tests, which must see no GPU
  step 540 pytest-dist.log "${PYTEST[@]}" --basetemp=/tmp/pt-dist tests/dist &
  step 540 pytest-e2e.log "${PYTEST[@]}" --basetemp=/tmp/pt-e2e tests/e2e
  wait
  exit 0
fi

step 340 gpu.log python benchmarks/gpu.py --out "$OUT/gpu-benchmark.md"
step 170 pytest-cpu.log "${PYTEST[@]}" --basetemp=/tmp/pt-cpu tests/kernels tests/unit &
step 170 pytest-gpu.log "${PYTEST[@]}" -m gpu --basetemp=/tmp/pt-gpu
wait
step 40 moe.log python benchmarks/moe.py experts --reps 5
