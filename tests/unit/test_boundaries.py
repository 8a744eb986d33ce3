"""Imports flow one way (STYLE.md section 1): models/ and kernels/ never touch torch.distributed or
parallel/ (not even inside a function), kernels/ nothing of pipetrain beyond itself, nothing below the
trainer imports the trainer or the CLI, and collectives go through parallel/comm.py."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
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


def test_only_comm_calls_torch_distributed_collectives_and_p2p():
    calls = ("all_reduce(", "all_gather", "reduce_scatter", "broadcast(", "isend(", "irecv(", "batch_isend_irecv",
             "send(", "recv(")
    for path in (ROOT / "pipetrain" / "parallel").glob("*.py"):
        if path.name == "comm.py":
            continue
        text = path.read_text()
        bad = [c for c in calls if f"dist.{c}" in text]
        assert not bad, f"parallel/{path.name} calls dist.{bad}; route it through parallel/comm.py"


def test_parallel_code_never_imports_the_trainer_or_cli():
    for path in (ROOT / "pipetrain" / "parallel").glob("*.py"):
        bad = {n for n in _imports(path) if n in ("pipetrain.trainer", "pipetrain.cli", "pipetrain.checkpoint")}
        assert not bad, f"{path.name} imports {bad}"


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
    assert "pipetrain.build" in graph and "pipetrain.parallel.schedules.replay" in graph, sorted(graph)
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
