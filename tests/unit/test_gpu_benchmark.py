"""benchmarks/gpu.py's CPU smoke: one command writes the markdown table with every row of issue 34's table
(pipetrain eager, kernels=torch, compile, fp8, fused loss, the plain loop, its torch.compile, transformers)."""
import importlib.util
import os
import subprocess
import sys
import time

import pytest
import torch

from tests.e2e.common import ROOT

ROWS = ["pipetrain Trainer (Triton kernels)", "pipetrain, PIPETRAIN_KERNELS=torch", "pipetrain, train.compile=true",
        "pipetrain, train.precision=fp8 |", "pipetrain, train.precision=fp8 + train.compile=true",
        "pipetrain, train.fused_loss=true", "pipetrain, train.fused_loss=false", "the same model in a plain PyTorch loop",
        "torch.compile of the plain loop", "transformers (sdpa)",
        "pipetrain, train.compile=true + PIPETRAIN_KERNELS=torch",
        "pipetrain, train.precision=fp8 + train.compile=true + PIPETRAIN_KERNELS=torch",
        "pipetrain, train.precision=fp8 + train.fp8_recipe=rowwise + train.compile=true",  # --full's
        "pipetrain, train.precision=fp8 + train.fp8_recipe=rowwise_with_gw_hp + train.compile=true",
        "pipetrain, train.compile=true + inductor.coordinate_descent_tuning",
        "pipetrain, train.compile=true + inductor.max_autotune"]


def test_gpu_benchmark_cpu_smoke_writes_every_row(tmp_path):
    out = tmp_path / "gpu.md"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py"), "--cpu-smoke", "--diagnose",
                           "--full", "--out", str(out), "--work-dir", str(tmp_path / "runs")], capture_output=True,
                          text=True, timeout=600, cwd=str(tmp_path), env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    assert "| model | implementation | tokens/s |" in text
    for row in ROWS:
        assert f"| {row}" in text, f"{row!r} missing from\n{text}"
    table = [line for line in text.splitlines() if line.startswith("| ") and "tok" not in line]
    measured = [line for line in table if line.split("|")[3].strip().replace(",", "").isdigit()]
    # every row runs on the CPU too (train.compile's rows with aot_eager)
    assert len(measured) == len(ROWS), text
    # each compiled row compiles its own graph (dynamo is reset between rows: no row reuses another's trace, which
    # would leave the PIPETRAIN_KERNELS=torch row running the Triton ops' graph), and an eager row none
    graphs = {line.split("|")[2].strip(): int(line.split("|")[8]) for line in measured}
    # the memory model's planned peak beside each pipetrain row (on the CPU: the torch references' count)
    planned = {line.split("|")[2].strip(): line.split("|")[6].strip() for line in measured}
    assert all(float(v) > 0 for row, v in planned.items() if row.startswith("pipetrain")), planned
    assert all(v == "n/a" for row, v in planned.items() if not row.startswith("pipetrain")), planned
    compiled = [row for row in graphs if "compile" in row]
    assert len(compiled) == 9 and all(graphs[row] >= 1 for row in compiled), graphs
    assert all(graphs[row] == 0 for row in graphs if row not in compiled), graphs
    assert "- pipetrain, train.precision=fp8 + train.compile=true / pipetrain, train.compile=true: " in text
    assert "kernel table" in text
    # --diagnose profiles the compile rows, pipetrain eager and the compiled plain loop: a row each in the profile
    # table, which starts with the label, and a table of their longest kernels (ops on the CPU), longest first
    for row in ("pipetrain, train.compile=true", "pipetrain, train.precision=fp8 + train.compile=true",
                "pipetrain, train.precision=fp8 + train.compile=true + PIPETRAIN_KERNELS=torch",
                "torch.compile of the plain loop", "pipetrain Trainer (Triton kernels)"):
        assert any(line.startswith(f"| {row} | ") for line in text.splitlines()), text
        top = text.split(f"Longest kernels per step, {row}:\n\n")[1].split("\n\n")[0].splitlines()[2:]
        ms = [float(line.split("|")[3]) for line in top]
        assert len(ms) >= 5 and ms == sorted(ms, reverse=True) and ms[0] > 0, top
    assert "GEMMs are " in text and "(Amdahl)" in text


def test_only_runs_the_rows_it_names_and_can_skip_the_kernel_table(tmp_path, monkeypatch):
    bench = _load("gpu", monkeypatch)
    done = []

    def fake_row(model, label, kind, overrides, setup, out_dir, peak):
        done.append(label)
        return {"implementation": label, "tokens_per_s": 1000.0, "first_step_s": 1.0, "step_s": 1.0,
                "peak_gib": None, "graphs": 0}

    monkeypatch.setattr(bench, "run_row", fake_row)
    monkeypatch.setattr(bench, "kernel_table", lambda setup, repeats: ["kernel table rows"])
    monkeypatch.setenv(bench.BACKEND_ENV, "aot_eager")
    out = tmp_path / "gpu.md"
    bench.main(["--cpu-smoke", "--out", str(out), "--only", "pipetrain, train.compile=true",
                "--only", "torch.compile of the plain loop", "--no-kernel-table"])
    assert done == ["pipetrain, train.compile=true", "torch.compile of the plain loop"]  # in the table's order
    assert "kernel table rows" not in out.read_text()
    bench.main(["--cpu-smoke", "--out", str(out), "--only", "transformers (sdpa)"])
    assert done[2:] == ["transformers (sdpa)"] and "kernel table rows" in out.read_text()
    with pytest.raises(SystemExit) as exc:  # a label that is no row's: refused before anything runs
        bench.main(["--cpu-smoke", "--out", str(out), "--only", "transformers"])
    assert exc.value.code == 2 and done[3:] == []


def test_ratios_say_met_or_missed_with_three_places(monkeypatch):
    """The H200's fp8 + compile / compile was 77,677 / 64,991 = 1.195: printed as 1.20x it read as the target met."""
    bench = _load("gpu", monkeypatch)
    rows = [{"implementation": "pipetrain, train.compile=true", "tokens_per_s": 64991.0},
            {"implementation": "pipetrain, train.precision=fp8 + train.compile=true", "tokens_per_s": 77677.0},
            {"implementation": "torch.compile of the plain loop", "tokens_per_s": 62974.0},
            {"implementation": "pipetrain Trainer (Triton kernels)", "status": "failed: out of memory"}]
    lines = bench.format_ratios(rows)
    assert ("- pipetrain, train.precision=fp8 + train.compile=true / pipetrain, train.compile=true: 1.195x "
            "(target >= 1.20x: missed)") in lines
    assert ("- pipetrain, train.compile=true / torch.compile of the plain loop: 1.032x (target >= 1.00x: met)"
            in lines)
    assert ("- pipetrain, train.compile=true / pipetrain Trainer (Triton kernels): n/a (target >= 1.10x)"
            in lines)


def test_the_default_profiles_the_two_compile_rows_and_diagnose_adds_the_baselines(tmp_path, monkeypatch):
    bench = _load("gpu", monkeypatch)
    profiled = []
    monkeypatch.setattr(bench, "run_row", lambda model, label, kind, overrides, setup, out_dir, peak: (
        profiled.append(setup.profiled) or {"implementation": label, "status": "skipped"}))
    monkeypatch.setattr(bench, "kernel_table", lambda setup, repeats: [])
    bench.main(["--cpu-smoke", "--out", str(tmp_path / "a.md"), "--only", "transformers (sdpa)"])
    assert set(profiled[-1]) == {"pipetrain, train.compile=true", "pipetrain, train.precision=fp8 + train.compile=true"}
    bench.main(["--cpu-smoke", "--diagnose", "--out", str(tmp_path / "b.md"), "--only", "transformers (sdpa)"])
    assert set(profiled[-1]) == set(profiled[0]) | {
        "pipetrain, train.precision=fp8 + train.compile=true + PIPETRAIN_KERNELS=torch",
        "torch.compile of the plain loop", "pipetrain Trainer (Triton kernels)"}


def test_without_a_gpu_it_says_so_and_exits_0_running_and_writing_nothing(tmp_path, monkeypatch, capsys):
    bench = _load("gpu", monkeypatch)
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench, "run_row", lambda *args: pytest.fail("a row ran without a GPU and --cpu-smoke"))
    out = tmp_path / "gpu-benchmark.md"
    assert bench.main(["--out", str(out)]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out and not out.exists()


def test_model_picks_the_models_in_the_order_given(monkeypatch):
    bench = _load("gpu", monkeypatch)
    assert bench.selected_models(["gpt-1b", "llama-1b"], False, False) == [bench.MODELS["gpt-1b"],
                                                                          bench.MODELS["llama-1b"]]
    assert bench.selected_models([], False, False) == [bench.MODELS["llama-1b"]]
    assert bench.selected_models([], True, False) == list(bench.MODELS.values())
    assert bench.selected_models(["gpt-1b"], False, True)[0][1] is bench.SMOKE
    smoke_moe = bench.selected_models(["moe"], False, True)  # the tiny llama, then a tiny MoE
    assert [m for _, m in smoke_moe] == [bench.SMOKE, bench.SMOKE_MOE] and bench.MOE_2B["num_experts"] == 8
    assert bench.MODELS["gpt-1b"][1]["vocab_size"] == 50304 and bench.MODELS["gpt-1b"][1]["family"] == "gpt2"
    with pytest.raises(SystemExit) as exc:
        bench.main(["--cpu-smoke", "--model", "gpt-2b"])
    assert exc.value.code == 2


def test_a_run_cut_short_keeps_the_rows_it_measured(tmp_path, monkeypatch):
    """The file is rewritten after every row, so a GPU session's time limit loses only the rows not yet run
    (they come in the order of issue 34's targets)."""
    bench = _load("gpu", monkeypatch)
    done = []

    def fake_row(model, label, kind, overrides, setup, out_dir, peak):
        if len(done) == 3:
            raise TimeoutError("the session's time limit")
        done.append(label)
        return {"implementation": label, "tokens_per_s": 1000.0 * len(done), "first_step_s": 1.0, "step_s": 1.0,
                "peak_gib": None, "graphs": 0}

    monkeypatch.setattr(bench, "run_row", fake_row)
    monkeypatch.setenv(bench.BACKEND_ENV, "aot_eager")  # main() sets it for the smoke: undone after the test
    out = tmp_path / "gpu.md"
    try:
        bench.main(["--cpu-smoke", "--out", str(out), "--work-dir", str(tmp_path / "runs")])
    except TimeoutError:
        pass
    assert done == ["pipetrain Trainer (Triton kernels)", "pipetrain, train.compile=true",
                    "pipetrain, train.precision=fp8 + train.compile=true"]
    text = out.read_text()
    assert all(f"| {label} | {1000 * (i + 1):,}" in text for i, label in enumerate(done)), text


def _load(name: str, monkeypatch=None):
    """benchmarks/<name>.py as a module (benchmarks/ stays off sys.path: its kernels.py would shadow kernels)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    if monkeypatch is not None:
        monkeypatch.setitem(sys.modules, f"bench_{name}", module)  # a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_the_step_profile_sorts_kernels_by_kind_and_bounds_what_faster_gemms_give():
    sp = _load("step_profile")
    names = {  # cuBLAS, flash attention, fused AdamW and NCCL names as an H100 trace shows them; inductor's after
        # the scheme of the CPU's (cpp_fused__to_copy_abs_amax_clamp_exp2_floor_log2_mul_reciprocal_view_0)
        "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_cublas": "gemm",
        "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT": "gemm",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>": "attention",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80": "attention",
        "triton_red_fused_abs_amax_0": "fp8 scaling",
        "triton_poi_fused__to_copy_clamp_mul_1": "fp8 scaling",
        "triton_poi_fused_exp2_floor_log2_reciprocal_2": "fp8 scaling",
        "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>": "optimizer",
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL": "communication",
        "triton_poi_fused_add_mul_silu_0": sp.OTHER,
        "aten::mm": "gemm",
    }
    assert {name: sp.category(name) for name in names} == names
    assert sp.amdahl_bound(0.0) == 1.0 and sp.amdahl_bound(1.0) == 2.0
    assert round(sp.amdahl_bound(0.6), 4) == round(1 / 0.7, 4)  # 40% unchanged + 60% at half the time
    table = sp.format_profiles({"row": dict(dict.fromkeys(sp.COLUMNS, 0.0), gemm=0.006, attention=0.002,
                                             **{sp.OTHER: 0.002})})
    assert table[2] == "| row | 2.0 | 6.0 | 0.0 | 0.0 | 0.0 | 2.0 | 10.0 | 60% |", table
    # with the timed step beside it
    table = sp.format_profiles({"row": dict(dict.fromkeys(sp.COLUMNS, 0.0), gemm=0.01)}, {"row": 0.0125})
    assert table[0].endswith("| gemm share | step ms |") and table[1].count("---:") == len(sp.COLUMNS) + 3
    assert table[2].endswith("| 10.0 | 100% | 12.5 |"), table
    # and the profiled steps' own timeline: a 13 ms step in which kernels ran 10.5 ms, so the GPU waited 2.5 ms
    # (not the timed step less the kernels' total: two runs, at two clocks); a row without one says n/a
    table = sp.format_profiles({"row": dict(dict.fromkeys(sp.COLUMNS, 0.0), gemm=0.01), "other": dict.fromkeys(sp.COLUMNS, 0.0)},
                               {"row": 0.0125}, {"row": (0.013, 0.0105)})
    assert table[0].endswith("| step ms | profiled step ms | GPU busy ms | GPU idle ms |"), table
    assert table[1].count("---:") == len(sp.COLUMNS) + 6
    assert table[2].endswith("| 10.0 | 100% | 12.5 | 13.0 | 10.5 | 2.5 |") and table[3].endswith("| n/a | n/a | n/a | n/a |")


def test_the_gpu_idle_time_is_put_down_to_the_host_op_running_in_each_gap():
    """Kernels 0-100, 90-200 (overlapping: no gap), 260-300, 1300-1400 (with 1310-1320 inside it, on another
    stream: the GPU stays busy to 1400) and 1450-1500 us; the host runs
    Optimizer.step from 250 to 1350 with an aten op inside it, and nothing from 1400 to 1500. Gaps: 200-260
    (60 us: under the 100 us floor, left out) and 300-1300 (1 ms, middle 800: Optimizer.step, the outermost op
    there, not the aten op inside it); 1400-1450 is under the floor too. Two steps: per step, half."""
    from types import SimpleNamespace
    sp = _load("step_profile")
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, device, start, end, annotation=False):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                               is_user_annotation=annotation)

    events = [event("gemm", cuda, 0, 100), event("add", cuda, 90, 200), event("norm", cuda, 260, 300),
              event("adam", cuda, 1300, 1400), event("copy", cuda, 1310, 1320), event("adam", cuda, 1450, 1500),
              event("Optimizer.step#AdamW.step", cuda, 250, 1350, annotation=True),  # a range, not a kernel
              event("Optimizer.step#AdamW.step", cpu, 250, 1350), event("aten::_foreach_mul_", cpu, 700, 900)]
    assert sp.idle_by_host_op(events, steps=2) == [("Optimizer.step#AdamW.step", 0.0005, 0)]
    # busy: 0-200, 260-300, 1300-1400 and 1450-1500 (the copy inside the adam, and the range, count nothing more)
    assert round(sp.busy_seconds(events, steps=2), 9) == 0.000195
    # a gap where the host runs no op at all (1500-2500), and a floor of 50 us that lets 200-260 and
    # 1400-1450 in (no host op at their middles either): 1.11 ms in 3 gaps, more than Optimizer.step's 1 ms
    events.append(event("matmul", cuda, 2500, 2600))
    rows = sp.idle_by_host_op(events, steps=1, min_gap_us=50)
    assert [(name, round(s, 8), n) for name, s, n in rows] == [("Python, outside any op", 0.00111, 3),
                                                              ("Optimizer.step#AdamW.step", 0.001, 1)], rows
    table = sp.format_idle("row", rows)
    assert table[4].endswith("| 1.11 | 3 |") and table[5] == "| `Optimizer.step#AdamW.step` | 1.00 | 1 |", table
    assert sp.format_idle("row", []) == ["GPU idle per step, row: no gap of 0.1 ms or more between kernels."]


def test_the_step_profile_counts_each_kernel_once_on_cuda():
    """Named ranges (inductor's compiled-graph call, Optimizer.step) are device events on CUDA too, spanning
    the kernels inside them: counting them would count those kernels twice."""
    from types import SimpleNamespace
    sp = _load("step_profile")
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(key, device, us, annotation=False):
        return SimpleNamespace(key=key, device_type=device, self_device_time_total=us, self_cpu_time_total=us,
                               is_user_annotation=annotation)

    events = [event("nvjet_tst_128x256", cuda, 6000), event("triton_poi_fused_add_mul_silu_0", cuda, 2000),
              event("## Call CompiledFxGraph fabc ##", cuda, 9000, annotation=True),
              event("Optimizer.step#AdamW.step", cuda, 1000, annotation=True),
              event("aten::mm", cpu, 500)]
    totals = sp.sum_by_category(events, on_cuda=True, steps=2)
    assert totals["gemm"] == 0.003 and totals[sp.OTHER] == 0.001 and totals["optimizer"] == 0.0, totals




def test_the_clocks_of_the_timed_steps_come_from_nvidia_smi_beside_them(tmp_path, monkeypatch):
    """benchmarks/clocks.py with a stand-in nvidia-smi on PATH that prints a sample every 50 ms until stopped
    (and one line a real card can print for a field it cannot read): medians of what it printed while the block
    ran, the lowest clock, the table; nothing without nvidia-smi or a GPU id."""
    clocks = _load("clocks")
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho \"$@\" > \"$(dirname \"$0\")/args\"\necho '[N/A], 700.00, 60'\n"
                   "i=0\nwhile true; do echo \"$((1980 - i * 10)), 690.5, 61\"; i=$((i + 1)); sleep 0.05; done\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with clocks.ClockSampler("GPU-1234") as sampler:
        time.sleep(0.6)
    c = sampler.summary
    assert c is not None and c["samples"] >= 3 and c["watts"] == 690.5 and c["celsius"] == 61
    assert c["min_sm_mhz"] == 1980 - 10 * (c["samples"] - 1) and c["sm_mhz"] < 1980
    args = (tmp_path / "args").read_text()
    assert "--id=GPU-1234" in args and "--query-gpu=clocks.sm,power.draw,temperature.gpu" in args
    slower = dict(c, sm_mhz=c["sm_mhz"] * 0.97)
    rows = [{"implementation": "eager", "clocks": c}, {"implementation": "oom"},
            {"implementation": "compile", "clocks": slower}]
    table = clocks.format_clocks(rows, [("compile", "eager"), ("oom", "eager")])
    assert table[4].startswith(f"| eager | {c['sm_mhz']:,.0f} | ") and len(table) == 8
    assert table[-1] == "- SM clock, compile / eager: 0.970"  # rows without clocks give no ratio
    with clocks.ClockSampler(None) as none:
        pass
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with clocks.ClockSampler("0") as missing:
        pass
    assert none.summary is None and missing.summary is None and clocks.format_clocks([{"implementation": "x"}]) == []



def test_every_gpu_session_command_names_rows_and_models_gpu_py_knows(tmp_path, monkeypatch):
    """benchmarks/gpu_session.sh in each mode on the CPU, with a stand-in python (and nvidia-smi: an H200's memory)
    that records its gpu.py commands; each is then given to gpu.py's own argument parsing, where an --only label
    or a --model it does not know exits 2. A lent GPU's session would lose that step's rows to a typo."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "calls.txt"
    shim = bin_dir / "python"
    shim.write_text(f"""#!/usr/bin/env bash
if [ "$1" = benchmarks/gpu.py ]; then shift; printf '%s\\n' "$@" >> {record}; echo '<end>' >> {record}; fi
exit 0
""")
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/usr/bin/env bash\ncase \"$*\" in *noheader*) echo 143771 ;; *) echo 'NVIDIA H200' ;; esac\n")
    for f in (shim, smi):
        f.chmod(0o755)
    tmp = tmp_path / "tmpdir"  # the script's own raw logs go under TMPDIR, never a fixed /tmp path (below)
    tmp.mkdir()
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", TMPDIR=str(tmp))
    for mode in ("", "vocab", "llama", "all", "check", "moe", "gpt", "tests"):
        env["OUT"] = str(tmp_path / f"out-{mode or 'default'}")
        proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_session.sh"), *([mode] if mode else [])],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    # `tests`: the gpu tests' log and the rest's, each with its count of outcomes (none ran under the stand-in)
    for log in ("pytest-gpu.log", "pytest.log"):
        text = (tmp_path / "out-tests" / log).read_text()
        assert "outcomes: 0 PASSED 0 FAILED 0 ERROR 0 SKIPPED" in text, text
    # each run of the script keeps pytest's whole logs in a folder of its own: this test, run inside the suite on
    # the GPU machine, once truncated the log the real suite was writing (/tmp/pytest.log), and no failure came back
    runs = sorted(tmp.glob("gpu-session.*"))
    assert len(runs) == 8, runs  # one a mode
    assert sorted(p.name for r in runs for p in r.iterdir()) == ["pytest-gpu.log", "pytest.log", "pytest.log",
                                                                "pytest.log"], runs  # all, check, tests
    calls = [c.strip("\n").split("\n") for c in record.read_text().split("<end>\n") if c.strip()]
    assert len(calls) == 1 + 1 + 1 + 1 + 1 + 1 + 1, calls  # default: gpt-1b; vocab; llama; all; check; moe; gpt
    # the default: the missed target's rows (compile / eager) and both of its experiments, on the gpt-1b's model
    assert calls[0][:2] == ["--model", "gpt-1b"] and {
        "pipetrain Trainer (Triton kernels)", "pipetrain, train.compile=true",
        "pipetrain, train.compile=true + inductor.coordinate_descent_tuning",
        "pipetrain, train.compile=true + inductor.max_autotune"} <= set(calls[0]), calls[0]
    assert calls[-2][:2] == ["--model", "moe"], calls[-2]
    assert calls[-1][:2] == ["--model", "gpt-1b"] and "pipetrain, train.precision=fp8 + train.compile=true" in calls[-1]
    assert {"pipetrain, train.fused_loss=false", "pipetrain, train.fused_loss=true"} <= set(calls[1]), calls[1]
    assert calls[2][:2] == ["--model", "llama-1b"] and "pipetrain, train.precision=fp8" in calls[2], calls[2]
    bench = _load("gpu", monkeypatch)
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)  # parse, then stop: no GPU here
    for argv in calls:
        assert bench.main(argv) == 0, argv
    with pytest.raises(SystemExit):  # what a typo'd label does
        bench.main(["--only", "pipetrain, train.precision=fp9"])


def test_an_inductor_override_is_set_for_its_row_alone_and_never_reaches_the_recipe(monkeypatch):
    import torch._inductor.config as inductor_config
    bench = _load("gpu", monkeypatch)
    assert bench._split_inductor(["train.compile=true", "inductor.coordinate_descent_tuning=true",
                                  "inductor.max_autotune=false", "inductor.unroll_reductions_threshold=4"]) == \
        (["train.compile=true"], {"coordinate_descent_tuning": True, "max_autotune": False,
                                  "unroll_reductions_threshold": 4})
    assert bench._split_inductor(None) == (None, {})
    seen = []

    def fake_pipetrain_row(model, overrides, setup, out_dir):
        seen.append((overrides, inductor_config.coordinate_descent_tuning, inductor_config.max_autotune))
        raise bench.ConfigError("stop here")
    monkeypatch.setattr(bench, "_pipetrain_row", fake_pipetrain_row)
    before = inductor_config.coordinate_descent_tuning, inductor_config.max_autotune
    setup = bench.Setup(torch.device("cpu"), torch.float32, 32, 2, 2, True, ())
    for label, kind, overrides in bench.FULL_ROWS:
        if "inductor." in " ".join(overrides):
            row = bench.run_row(bench.SMOKE, label, kind, overrides, setup, "/nonexistent", None)
            assert row["status"].startswith("unsupported: stop here"), row
    assert seen == [(["train.compile=true"], True, before[1]), (["train.compile=true"], True, True)]
    assert (inductor_config.coordinate_descent_tuning, inductor_config.max_autotune) == before  # restored
