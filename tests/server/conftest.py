"""Fixtures of the server tests: a tiny random model that has a real tokenizer."""

from __future__ import annotations

import pytest
from tiny_models import save_tiny_model


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> str:
    """A random 2-layer Llama with the default model's tokenizer (and chat template), so that text
    goes through a real tokenizer while generation stays fast on a CPU."""
    from minfer.models.loader import load_tokenizer, resolve_model

    path = tmp_path_factory.mktemp("tiny-chat")
    save_tiny_model("llama", path, vocab_size=49152, max_position_embeddings=4096)
    load_tokenizer(resolve_model(None)).save_pretrained(path)
    return str(path)
