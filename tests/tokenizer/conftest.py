"""The default model's tokenizer (byte-level BPE with special tokens and a chat template)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    from minfer.models.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(None))
