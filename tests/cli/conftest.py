"""The real `minfer` command in a subprocess, and a Hugging Face cache laid out as the hub
library lays it out (blobs, refs/main, snapshots/<commit>/ of symlinks into blobs)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_harness import HUB_COMMIT, HUB_REPO_ID, populate_hub_cache


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory, tiny_chat_model) -> Path:
    """A cache directory holding HUB_REPO_ID at HUB_COMMIT (the tiny chat model)."""
    cache = tmp_path_factory.mktemp("hf-cache")
    populate_hub_cache(cache, Path(tiny_chat_model), HUB_REPO_ID, HUB_COMMIT)
    return cache
