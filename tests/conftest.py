import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need a GPU: skip them cleanly where there is none (CI)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
