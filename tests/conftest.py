import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run under the interpreter on the CPU; set before any test module is imported (see
    # tests/test_kernels_triton.py): triton reads it as kernels are decorated.
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need a GPU: skip them cleanly where there is none (CI)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
