"""Kernel tests run on CPU through Triton's interpreter when there is no GPU.

The interpreter is chosen when a kernel is defined (at import), so the variable must be set
before any minfer.kernels module is imported; conftest is loaded before the test modules.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    return DEVICE
