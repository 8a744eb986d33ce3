"""Imports flow one way (STYLE.md section 1): models/ and kernels/ never touch torch.distributed or
parallel/ (not even inside a function), kernels/ nothing of pipetrain beyond itself, nothing below the
trainer imports the trainer or the CLI, and collectives go through parallel/mesh/comm.py."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _imports(path: pathlib.Path, root: pathlib.Path = ROOT) -> set[str]:
    """Every module an import in path names, however spelled: relative imports resolved against path's package
    (root/kernels is installed as pipetrain.kernels), and `from pkg import name` counted as pkg and pkg.name
    (name may be a module: `from pipetrain.parallel import tensor` imports parallel.tensor)."""
    package = list(path.relative_to(root).parts[:-1])  # a module's and an __init__'s package: its folder
    if package[:1] == ["kernels"]:
        package.insert(0, "pipetrain")
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            anchor = package[:len(package) - node.level + 1] if node.level else []
            base = ".".join(anchor + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_models_are_blind_to_parallelism():
    for path in (ROOT / "pipetrain" / "models").glob("*.py"):
        bad = {n for n in _imports(path) if n.startswith(("torch.distributed", "pipetrain.parallel",
                                                           "pipetrain.trainer", "pipetrain.cli"))}
        assert not bad, f"{path.name} imports {bad}"


def test_kernels_know_nothing_of_processes_or_the_rest_of_pipetrain():
    paths = sorted((ROOT / "kernels").glob("*.py"))
    assert paths, "no kernel modules found"
    for path in paths:
        bad = {n for n in _imports(path) if n.startswith("torch.distributed")
               or (n.startswith("pipetrain") and not n.startswith("pipetrain.kernels"))}
        assert not bad, f"kernels/{path.name} imports {bad}"


# torch.distributed calls that move no data and may appear anywhere
QUERIES = {"is_available", "is_initialized", "get_rank", "get_world_size", "get_backend"}
# (file under pipetrain/, torch.distributed name) -> why that file calls it directly instead of through comm
ALLOWED = {
    ("cli.py", "init_process_group"): "starting the run's process group is the CLI's job (before any comm)",
    ("cli.py", "destroy_process_group"): "tearing it down at exit, after comm's last collective",
    ("cli.py", "TCPStore"): "the rendezvous store of a torchrun restart, not a collective",
    ("cli.py", "PrefixStore"): "prefixes that store's keys per restart attempt",
    ("parallel/mesh/dims.py", "new_group"): "ParallelDims is the only creator of process groups (STYLE.md)",
    ("parallel/mesh/dims.py", "DeviceMesh"): "ParallelDims builds the device mesh",
    ("parallel/replicas/failover.py", "TCPStore"): "the replica group's store for torchft's manager, not a collective",
    ("plan/calibrate.py", "init_process_group"): "calibration runs its own two-process world",
    ("plan/calibrate.py", "destroy_process_group"): "and tears it down",
}


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id] + parts[::-1])


def distributed_calls(source: str) -> list[tuple[int, str]]:
    """(line, name) of every call into torch.distributed in source, however it was imported (import
    torch.distributed as X, from torch.distributed import f, from torch import distributed, torch.distributed.f)."""
    tree = ast.parse(source)
    alias = {}  # local name -> the module path or object it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (name := _dotted(node.func)):
            head, _, rest = name.partition(".")
            full = ".".join(p for p in (alias.get(head, head), rest) if p)
            if full.startswith("torch.distributed."):
                found.append((node.lineno, full.rsplit(".", 1)[-1]))
    return found


def test_the_collective_scan_finds_every_spelling():
    for source in ("import torch.distributed as dist\ndist.all_reduce(x)",
                   "from torch.distributed import all_reduce as ar\nar(x)",
                   "import torch.distributed\ntorch.distributed.all_reduce(x)",
                   "from torch import distributed\ndef f():\n    distributed.all_reduce(x)"):
        assert distributed_calls(source) == [(source.count("\n") + 1, "all_reduce")], source
    assert distributed_calls("import torch\ntorch.all_reduce(x)\nall_reduce(x)") == []


def test_only_comm_calls_torch_distributed():
    """Every collective goes through parallel/mesh/comm.py (its device check sees them all): anywhere else in
    pipetrain/, a torch.distributed call is a query or on the allow-list, with its reason."""
    used, bad = set(), []
    for path in sorted((ROOT / "pipetrain").rglob("*.py")):
        rel = path.relative_to(ROOT / "pipetrain").as_posix()
        if rel == "parallel/mesh/comm.py":
            continue
        for line, name in distributed_calls(path.read_text()):
            if name in QUERIES:
                continue
            if (rel, name) in ALLOWED:
                used.add((rel, name))
            else:
                bad.append(f"pipetrain/{rel}:{line} calls torch.distributed.{name}")
    assert not bad, "route these through pipetrain/parallel/mesh/comm.py (or allow-list them, saying why):\n" + \
        "\n".join(bad)
    assert used == set(ALLOWED), f"allow-list entries no file needs any more: {sorted(set(ALLOWED) - used)}"


# package -> the pipetrain packages its modules may import (besides itself): the layers of
# docs/architecture.md. kernels know nothing of pipetrain; models know the schema and the kernels, never
# a layout; parallel/ builds on those and the optimizer pieces, never on what assembles or drives a run
# (build, trainer, cli, checkpoint, data, plan, hf).
LAYERS = {
    "kernels": set(),
    "models": {"config", "kernels"},
    "parallel": {"config", "faults", "kernels", "models", "optim"},
}
# parallel sub-packages (besides LAYERS' "parallel" rule) that may import only these parallel siblings, as
# their __init__ says: parallel/expert plugs into the MoE layer and the data-parallel optimizers
PARALLEL_SIBLINGS = {"expert": {"mesh", "data"}}


def sibling_violations(root: pathlib.Path) -> list[str]:
    bad = []
    for pkg, allowed in PARALLEL_SIBLINGS.items():
        paths = sorted((root / "pipetrain" / "parallel" / pkg).rglob("*.py"))
        assert paths, f"no modules found under parallel/{pkg}"
        for path in paths:
            siblings = {n.split(".")[2] for n in _imports(path, root) if n.startswith("pipetrain.parallel.")}
            if not siblings <= allowed | {pkg}:
                bad.append(f"parallel/{pkg}/{path.name} imports parallel.{sorted(siblings - allowed - {pkg})}")
    return bad


def test_parallel_subpackages_import_only_their_siblings():
    bad = sibling_violations(ROOT)
    assert not bad, "\n".join(bad)


def test_the_sibling_scan_sees_every_spelling(tmp_path):
    """`from pipetrain.parallel import tensor` and `from ..tensor import fp8` passed the scan, which read only
    absolute module names below pipetrain.parallel."""
    folder = tmp_path / "pipetrain" / "parallel" / "expert"
    folder.mkdir(parents=True)
    for source in ("import pipetrain.parallel.tensor.fp8", "from pipetrain.parallel.tensor import fp8",
                   "from pipetrain.parallel import tensor", "from ..tensor import fp8", "from .. import tensor",
                   "def f():\n    from ..pipeline.stage import build_stage"):
        (folder / "m.py").write_text(source)
        assert len(sibling_violations(tmp_path)) == 1, source
    for source in ("from ..mesh import comm", "from . import dispatch", "from pipetrain.parallel.data import zero"):
        (folder / "m.py").write_text(source)
        assert sibling_violations(tmp_path) == [], source


def _pipetrain_imports(path: pathlib.Path, root: pathlib.Path = ROOT) -> set[str]:
    """The top-level pipetrain package (or module) of every pipetrain import in path, absolute or relative."""
    return {name.split(".")[1] for name in _imports(path, root) if name.startswith("pipetrain.")}


def layer_violations(root: pathlib.Path) -> list[str]:
    bad = []
    for layer, allowed in LAYERS.items():
        folder = root / "kernels" if layer == "kernels" else root / "pipetrain" / layer
        paths = sorted(folder.rglob("*.py"))
        assert paths, f"no modules found under {folder}"
        for path in paths:
            extra = _pipetrain_imports(path, root) - allowed - {layer}
            if extra:
                bad.append(f"{path.relative_to(root)} imports pipetrain.{sorted(extra)}")
    return bad


def test_each_layer_imports_only_the_layers_below_it():
    assert len(list((ROOT / "pipetrain" / "parallel").rglob("*.py"))) > 20, "the scan must reach sub-packages"
    bad = layer_violations(ROOT)
    assert not bad, "imports against the layers (docs/architecture.md):\n" + "\n".join(bad)


def test_the_layer_scan_sees_every_spelling(tmp_path):
    for source in ("import pipetrain.build", "from pipetrain.trainer import Trainer", "from pipetrain import cli",
                   "def f():\n    from pipetrain.checkpoint import load", "from ...checkpoint import load",
                   "from ... import trainer"):  # relative: m.py's package is pipetrain.parallel.x
        (tmp_path / "pipetrain" / "parallel" / "x").mkdir(parents=True, exist_ok=True)
        for layer in ("models", "kernels"):
            (tmp_path / ("kernels" if layer == "kernels" else f"pipetrain/{layer}")).mkdir(parents=True, exist_ok=True)
            (tmp_path / ("kernels" if layer == "kernels" else f"pipetrain/{layer}") / "ok.py").write_text("")
        (tmp_path / "pipetrain" / "parallel" / "x" / "m.py").write_text(source)
        assert len(layer_violations(tmp_path)) == 1, source


def test_only_dims_creates_process_groups():
    for path in (ROOT / "pipetrain").rglob("*.py"):
        if path.name != "dims.py":
            assert "new_group(" not in path.read_text(), f"{path} creates a process group"


def test_no_pickle_based_loading_in_product_code():
    for folder in ("pipetrain", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            for needle in ("torch.load(", "torch.save(", "pickle.load", "pickle.dump"):
                assert needle not in text, f"{path} uses {needle}"


def _module_graph() -> dict[str, set[str]]:
    """pipetrain module -> the pipetrain modules it imports anywhere (function bodies and __main__ blocks
    included; `from pkg import name` counts as importing pkg.name when that is a module)."""
    files = {}
    for path in (ROOT / "pipetrain").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in (ROOT / "kernels").glob("*.py"):
        files["pipetrain.kernels" + ("" if path.stem == "__init__" else "." + path.stem)] = path
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in node.names)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def test_the_package_has_no_import_cycles():
    graph = _module_graph()
    assert "pipetrain.build" in graph and "pipetrain.parallel.pipeline.schedules.replay" in graph, sorted(graph)
    state: dict[str, int] = {}  # 1 on the current path, 2 finished

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt])
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
