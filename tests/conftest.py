"""Fixtures shared by all tests."""

from __future__ import annotations

import pytest

from tiny_models import ARCHS, save_tiny_model


@pytest.fixture(scope="session", params=ARCHS)
def tiny_model(request, tmp_path_factory):
    """(arch, path, hf_model) for each architecture."""
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return request.param, str(path), save_tiny_model(request.param, path)
