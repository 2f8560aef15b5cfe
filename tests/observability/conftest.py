"""Fixtures of the observability tests: tiny random models saved once per session."""

from __future__ import annotations

import pytest
from tiny_models import save_tiny_chat_model, save_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A random 2-layer Llama without a tokenizer (prompts are token ids)."""
    path = tmp_path_factory.mktemp("tiny-trace")
    save_tiny_model("llama", path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_chat_llama(tmp_path_factory) -> str:
    """A random 2-layer Llama with the default model's tokenizer, for `minfer serve`."""
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-metrics"))


@pytest.fixture(scope="session")
def mixed_trace(tiny_llama, tmp_path_factory) -> str:
    """The path of a trace of `run_mixed_workload` (overlap on, page size 1, 128-token pool, and
    a host KV tier of 2048 tokens behind it, so evictions and hits move pages between tiers)."""
    from trace_workloads import finish_trace, run_mixed_workload, traced_llm

    path = tmp_path_factory.mktemp("mixed") / "mixed.jsonl"
    llm = traced_llm(
        tiny_llama,
        path,
        kv_cache_tokens=128,
        chunked_prefill_size=16,
        host_kv_cache_gb=2048 * 512 / (1 << 30),
    )
    run_mixed_workload(llm)
    finish_trace(llm, path)
    return str(path)
