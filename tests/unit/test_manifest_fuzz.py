"""A seeded manifest fuzzer: every mutation of a real checkpoint's manifest (delete, retype, reshape,
reorder, swap keys and values; sometimes re-sealed with a fresh checksum, as a buggy writer would)
ends in a ConfigError (the CLI's exit 2) or in an accepted manifest whose tensors are bitwise the
intact ones. Verification only, in-process: one small tp2 run saves the checkpoint, no case trains."""
import copy
import json
import os
import random
import shutil

import pytest
import torch

from pipetrain.checkpoint.read import TensorReader, read_manifest
from pipetrain.checkpoint.manifest import CHECKSUM_KEY, SAFETENSORS_DTYPES, seal
from pipetrain.config import ConfigError
from tests.e2e.common import run_train
from tests.harness import run_script

CASES = 400


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(checkpoint dir, intact manifest, every tensor read through the intact manifest)."""
    out = tmp_path_factory.mktemp("fuzz-run")
    proc, _ = run_train(str(out), ["train.steps=1", "run.eval_every=0", "parallel.tp=2"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = str(out / "checkpoints" / "step-00000001")
    manifest = read_manifest(ckpt)
    return ckpt, manifest, _read_all(ckpt, manifest)


def _read_all(ckpt, manifest, names=None) -> dict:
    reader = TensorReader(ckpt, manifest, verify=False)  # the files are intact; hashing them 400 times is slow
    return {name: reader.read(name, [0] * len(info["global_shape"]), info["global_shape"])
            for name, info in manifest["tensors"].items() if names is None or name in names}


def _paths(obj, prefix=()):
    """Every (path, value) in a JSON tree."""
    yield prefix, obj
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from _paths(v, prefix + (k,))


def _parent(root, path):
    for k in path[:-1]:
        root = root[k]
    return root


def _mutate(manifest: dict, rng: random.Random) -> tuple[dict, str]:
    m = copy.deepcopy(manifest)
    paths = [p for p, _ in _paths(m) if p]
    # bias towards the parts that decide tensors: tensors, files, rng, layout, step
    hot = [p for p in paths if p[0] in ("tensors", "files", "rng", "layout", "step", "format_version")]
    path = rng.choice(hot if rng.random() < 0.8 else paths)
    parent, key = _parent(m, path), path[-1]
    value = parent[key]
    op = rng.choice(["delete", "retype", "reshape", "reorder", "swap", "dtype"])
    if op == "delete":
        del parent[key]
    elif op == "retype":
        parent[key] = rng.choice([str(value), None, [value], {"v": value}, 1.5, True, -1, "bfloat16", 0])
    elif op == "reshape":
        ints = [p for p in paths if isinstance(_parent(m, p)[p[-1]], list)
                and all(isinstance(v, int) for v in _parent(m, p)[p[-1]])]
        p = rng.choice(ints)
        lst = _parent(m, p)[p[-1]]
        choice = rng.random()
        if lst and choice < 0.6:
            i = rng.randrange(len(lst))
            lst[i] = max(0, lst[i] + rng.choice([-1, 1, 2, lst[i] or 1]))
        elif lst and choice < 0.8:
            lst.pop()
        else:
            lst.append(rng.randrange(4))
        path = p
    elif op == "reorder":
        if isinstance(value, dict):
            keys = list(value)
            rng.shuffle(keys)
            parent[key] = {k: value[k] for k in keys}
        elif isinstance(value, list):
            rng.shuffle(value)
        else:
            keys = list(parent) if isinstance(parent, dict) else None
            if keys:
                rng.shuffle(keys)
                reordered = {k: parent[k] for k in keys}
                parent.clear()
                parent.update(reordered)
    elif op == "swap":
        if isinstance(parent, dict) and len(parent) > 1:
            other = rng.choice([k for k in parent if k != key])
            if rng.random() < 0.5:
                parent[key], parent[other] = parent[other], parent[key]  # swap values
            else:
                renamed = {(other if k == key else key if k == other else k): v for k, v in parent.items()}
                parent.clear()
                parent.update(renamed)  # swap keys
        elif isinstance(parent, list) and len(parent) > 1:
            j = rng.randrange(len(parent))
            parent[key], parent[j] = parent[j], parent[key]
        else:
            parent[key] = str(value)
    else:  # dtype
        dtypes = [p for p in paths if p[-1] == "dtype"]
        p = rng.choice(dtypes)
        _parent(m, p)["dtype"] = rng.choice(sorted(SAFETENSORS_DTYPES) + ["float8", "torch.float32"])
        path = p
    resealed = rng.random() < 0.5
    if resealed:
        m.pop(CHECKSUM_KEY, None)
        try:
            m = seal(m)
        except ValueError:  # a value canonical JSON refuses; keep it unsealed
            resealed = False
    return m, f"{op} at {'/'.join(map(str, path))}{' (re-sealed)' if resealed else ''}"


def _case_dir(root, ckpt, manifest) -> str:
    case = os.path.join(root, os.path.basename(ckpt))
    shutil.rmtree(case, ignore_errors=True)
    os.makedirs(case)
    for name in os.listdir(ckpt):
        if name.endswith(".safetensors"):
            os.link(os.path.join(ckpt, name), os.path.join(case, name))  # hard: a checkpoint holding a symlink is refused
    with open(os.path.join(case, "manifest.json"), "w") as f:
        f.write(json.dumps(manifest))
    return case


def test_every_manifest_mutation_is_refused_or_reads_the_intact_tensors(saved, tmp_path):
    ckpt, intact, tensors = saved
    rng = random.Random(23)
    outcomes = {"refused": 0, "accepted": 0}
    for i in range(CASES):
        mutated, what = _mutate(intact, rng)
        case = _case_dir(str(tmp_path), ckpt, mutated)
        try:
            manifest = read_manifest(case)
            # a read depends only on the tensor's entry and the (intact) files: read the changed ones
            changed = {n for n, info in manifest["tensors"].items() if info != intact["tensors"].get(n)}
            got = _read_all(case, manifest, changed)
        except ConfigError:
            outcomes["refused"] += 1
            continue
        except Exception as exc:  # noqa: BLE001 - the claim under test: nothing but ConfigError escapes
            pytest.fail(f"case {i} ({what}): {type(exc).__name__}: {exc}")
        assert manifest["tensors"].keys() == tensors.keys(), f"case {i} ({what}) accepted with other tensors"
        for name in got:
            assert got[name].dtype == tensors[name].dtype and torch.equal(got[name], tensors[name]), \
                f"case {i} ({what}) accepted with a different {name}"
        outcomes["accepted"] += 1
    assert outcomes["refused"] > CASES // 2 and outcomes["accepted"] > 0, outcomes
    print(outcomes)


def test_tools_refuse_a_corrupt_manifest_with_exit_2(saved, tmp_path):
    ckpt, intact, _ = saved
    m = copy.deepcopy(intact)
    next(iter(m["tensors"].values()))["dtype"] = "bfloat16"  # the silent rounding, not re-sealed
    case = _case_dir(str(tmp_path), ckpt, m)
    for cmd in (["inspect", case], ["consolidate", case, str(tmp_path / "full")]):
        proc = run_script("pipetrain.checkpoint", cmd, timeout=120)
        assert proc.returncode == 2 and "manifest checksum does not match" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


@pytest.mark.parametrize("edit,message", [
    (lambda m: m["data"].update(samples=10 ** 30), r"data.samples should be a non-negative int"),
    (lambda m: m["recipe"]["model"].update(d_model="abc"), r"recipe.model.d_model='abc' must be int"),
    (lambda m: m["recipe"]["model"].update(n_kv_heads=[2]), r"recipe.model.n_kv_heads=\[2\] must be int"),
])
def test_a_resealed_manifest_with_values_out_of_range_or_of_the_wrong_type_is_refused(saved, tmp_path, edit, message):
    """Values a model or the loader would crash on (an OverflowError, a TypeError in torch.empty) in a manifest
    whose checksum was recomputed, as a buggy writer or another version would."""
    ckpt, intact, _ = saved
    m = copy.deepcopy(intact)
    edit(m)
    case = _case_dir(str(tmp_path), ckpt, seal({k: v for k, v in m.items() if k != CHECKSUM_KEY}))
    with pytest.raises(ConfigError, match=message):
        read_manifest(case)


def test_a_run_folder_or_a_manifest_file_given_for_a_checkpoint_is_named_as_such(saved):
    """Not "manifest.json is missing (an incomplete save?)", which sent users looking for damage."""
    ckpt, _, _ = saved
    run = os.path.dirname(os.path.dirname(ckpt))
    with pytest.raises(ConfigError, match=r"is a run folder, not a checkpoint folder; pass a checkpoints/step-"):
        read_manifest(run)
    with pytest.raises(ConfigError, match=r"manifest.json: is a file, not a checkpoint folder"):
        read_manifest(os.path.join(ckpt, "manifest.json"))
    with pytest.raises(ConfigError, match=r"step-00000009: no such folder; pass a checkpoints/step-"):
        read_manifest(os.path.join(run, "checkpoints", "step-00000009"))
