"""Fixtures of the observability tests: tiny random models saved once per session."""

from __future__ import annotations

import pytest
from tiny_models import save_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A random 2-layer Llama without a tokenizer (prompts are token ids)."""
    path = tmp_path_factory.mktemp("tiny-trace")
    save_tiny_model("llama", path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_chat_llama(tmp_path_factory) -> str:
    """A random 2-layer Llama with the default model's tokenizer, for `minfer serve`."""
    from minfer.models.loader import load_tokenizer, resolve_model

    path = tmp_path_factory.mktemp("tiny-chat-metrics")
    save_tiny_model("llama", path, vocab_size=49152, max_position_embeddings=4096)
    load_tokenizer(resolve_model(None)).save_pretrained(path)
    return str(path)
