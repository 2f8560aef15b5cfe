"""Fixtures of the server tests: a tiny random model that has a real tokenizer."""

from __future__ import annotations

import pytest
from tiny_models import save_tiny_chat_model


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> str:
    """A random 2-layer Llama with the default model's tokenizer (tiny_models.save_tiny_chat_model)."""
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
