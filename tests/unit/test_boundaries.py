"""Imports flow one way (STYLE.md section 1): models/ never touches torch.distributed or parallel/,
and nothing below the trainer imports the trainer or the CLI."""
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
