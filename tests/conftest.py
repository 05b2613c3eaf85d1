import atexit
import importlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run under the interpreter on the CPU; set before any test module is imported (see
    # tests/kernels/test_kernels_triton.py): triton reads it as kernels are decorated.
    os.environ["TRITON_INTERPRET"] = "1"


def import_hub_kernels() -> None:
    """transformers (5.25 on) imports the Hugging Face Hub's `kernels` package where it is installed; pytest puts
    the repository's root on sys.path, where this project's kernels/ (installed as llamaterm.kernels) would be found
    under that name instead. Import the Hub's first, from everywhere but the root, so sys.modules holds it."""
    root = Path(__file__).resolve().parents[1]
    saved = sys.path[:]
    sys.path[:] = [p for p in saved if Path(p or ".").resolve() != root]
    try:
        importlib.import_module("kernels")
    except ImportError:  # not installed: transformers then does not ask for it
        pass
    finally:
        sys.path[:] = saved


import_hub_kernels()

# `llamaterm serve` announces itself in the user's runtime directory, where `run` finds it (app/announcements.py): the
# tests' servers and runs, subprocesses too, meet in a folder of their own, never the user's
RUNTIME_DIR = os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="llamaterm-tests-")
atexit.register(shutil.rmtree, RUNTIME_DIR, ignore_errors=True)
# nor do they read the user's presets (app/presets.py): their config folder is empty unless a test writes one
CONFIG_DIR = os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="llamaterm-tests-config-")
atexit.register(shutil.rmtree, CONFIG_DIR, ignore_errors=True)

# The fast lane (`make test-fast`, `pytest --fast`) leaves out the tests marked slow (pyproject.toml says which are),
# and fails a test that takes longer than this there (its setup included), so that a test of many seconds added
# without the mark shows up at once. The fast lane's own tests take a few seconds each at most.
FAST_TEST_S = 15.0
TOOK = pytest.StashKey[float]()


def pytest_addoption(parser):
    parser.addoption(
        "--fast", action="store_true", help="the fast lane: leave out the tests marked slow (tests/conftest.py)"
    )


def pytest_collection_modifyitems(config, items):
    """Every test module is in a room: a package tests/<room>/ (tests/__init__.py lists them). The fast lane leaves
    out the slow tests. Tests marked `cuda` need a GPU: skip them cleanly where there is none (CI)."""
    outside = sorted({item.nodeid.split("::")[0] for item in items if not in_a_room(item)})
    if outside:
        raise pytest.UsageError(
            f"test modules outside a room: {', '.join(outside)}; put each in a tests/<room>/ folder that has an "
            "__init__.py (see tests/__init__.py)"
        )
    if config.getoption("fast"):
        slow = [item for item in items if item.get_closest_marker("slow")]
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def in_a_room(item: pytest.Item) -> bool:
    """Imported as tests.<room>.<module>: a package, so that two rooms may hold modules of the same name."""
    module = getattr(item, "module", None)
    parts = module.__name__.split(".") if module else []
    return len(parts) == 3 and parts[0] == "tests" and parts[1] != "support"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if not item.config.getoption("fast") or report.when == "teardown":
        return
    took = item.stash[TOOK] = item.stash.get(TOOK, 0.0) + call.duration
    if report.when == "call" and report.passed and took > FAST_TEST_S:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} took {took:.1f} s, over the fast lane's {FAST_TEST_S:.0f} s: mark it @pytest.mark.slow "
            "(pyproject.toml's markers say what slow means)"
        )
