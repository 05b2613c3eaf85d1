import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run under the interpreter on the CPU; set before any test module is imported (see
    # tests/kernels/test_kernels_triton.py): triton reads it as kernels are decorated.
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    """Every test module is in a room: a package tests/<room>/ (tests/__init__.py lists them). Tests marked `cuda`
    need a GPU: skip them cleanly where there is none (CI)."""
    outside = sorted({item.nodeid.split("::")[0] for item in items if not in_a_room(item)})
    if outside:
        raise pytest.UsageError(
            f"test modules outside a room: {', '.join(outside)}; put each in a tests/<room>/ folder that has an "
            "__init__.py (see tests/__init__.py)"
        )
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
