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
