"""Imports flow one way (app -> engine -> kernels), and inside the engine as engine/__init__.py says: checkpoints/
imports no other room, store/ only checkpoints/, and no room imports bench.py, which sits above them all. Read from
the sources, so a lazy import inside a function counts too. And a test module imports what tests share from
tests/support (or the benchmark it tests), never another test module."""

import ast
from pathlib import Path

from tests.support import ROOT

ROOMS = ("checkpoints", "store", "serving")


def imported(path: Path) -> set[str]:
    """The llamaterm modules a source file imports, wherever in it."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out |= {n for n in names if n.startswith("llamaterm.")}
    return out


def imports_of(folder: str) -> dict[str, set[str]]:
    return {str(p.relative_to(ROOT)): imported(p) for p in (ROOT / folder).rglob("*.py")}


def test_kernels_import_no_engine_and_the_engine_no_app():
    for module, names in imports_of("kernels").items():
        assert not {n for n in names if n.startswith(("llamaterm.engine", "llamaterm.app"))}, module
    for module, names in imports_of("engine").items():
        assert not {n for n in names if n.startswith("llamaterm.app")}, module


def test_the_engine_s_rooms_import_as_its_package_says():
    for room in ROOMS:
        for module, names in imports_of(f"engine/{room}").items():
            assert "llamaterm.engine.bench" not in names, module  # the benchmark is off the serving path
            others = {r for r in ROOMS if r != room and any(n.startswith(f"llamaterm.engine.{r}") for n in names)}
            allowed = {"checkpoints": set(), "store": {"checkpoints"}, "serving": {"checkpoints", "store"}}[room]
            assert others <= allowed, (module, others)


def test_test_modules_import_from_support_never_from_each_other():
    for path in (ROOT / "tests").rglob("test_*.py"):
        tree = ast.parse(path.read_text())
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not {m for m in modules if m.startswith("tests.") and m.rpartition(".")[2].startswith("test_")}, path
