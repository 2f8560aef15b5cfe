"""Fixtures shared by all tests."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter. Triton reads this when a kernel is
# defined (at import), so it is set here, before any test module can import minfer.kernels.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# Every scheduler step in the tests (in-process engines and the servers they start, which inherit
# the environment) checks that each KV page is owned exactly once (KVManager.check).
os.environ.setdefault("MINFER_CHECK_KV_INVARIANTS", "1")

from tiny_models import ARCHS, save_tiny_chat_model, save_tiny_model


@pytest.fixture(scope="session", params=ARCHS)
def tiny_model(request, tmp_path_factory):
    """(arch, path, hf_model) for each architecture."""
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return request.param, str(path), save_tiny_model(request.param, path)


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> str:
    """A random 2-layer Llama with the default model's tokenizer (tiny_models.save_tiny_chat_model)."""
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="session")
def default_model_server(tmp_path_factory):
    """One `minfer serve` of the default model (README's flags), shared by every module that only
    talks to it: each start costs ~10 s of the 2-core suite. One thread, the slowest case for the
    README's answer-time bound. Its clean exit is checked once, at the end of the session."""
    from server_harness import Server

    srv = Server(
        ["--max-model-len", "1024", "--kv-cache-tokens", "4096"],
        tmp_path_factory.mktemp("default-server") / "server.log",
        env={"OMP_NUM_THREADS": "1"},
    )
    yield srv
    assert srv.stop() == 0
