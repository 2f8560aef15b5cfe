"""Which prefill passes a GPU engine would capture (engine/prefill_graph.py
`prefill_graph_tokens`), read off real engines built on the CPU: the flag, the chunk size, the
context length and a MoE model's cap."""

from __future__ import annotations

import pytest
from tiny_models import save_tiny_model

from minfer.config import ConfigError
from minfer.engine.prefill_graph import prefill_graph_tokens


def _tokens(path, **kw) -> int:
    from minfer import LLM

    return prefill_graph_tokens(LLM(str(path), kv_cache_tokens=4096, **kw).engine)


def test_dense_model_follows_the_flag_the_chunk_and_the_context(tmp_path):
    save_tiny_model("qwen3", tmp_path, max_position_embeddings=4096)
    assert _tokens(tmp_path, chunked_prefill_size=1000) == 1000  # default: the chunk
    assert _tokens(tmp_path, chunked_prefill_size=1000, prefill_cuda_graph_max_tokens=300) == 300
    assert _tokens(tmp_path, chunked_prefill_size=1000, prefill_cuda_graph_max_tokens=5000) == 1000
    assert _tokens(tmp_path, chunked_prefill_size=8192, max_model_len=2000) == 2000
    assert _tokens(tmp_path, prefill_cuda_graph_max_tokens=0) == 0


def test_moe_model_is_capped_where_the_align_kernel_stops(tmp_path):
    save_tiny_model("qwen3_moe", tmp_path, max_position_embeddings=4096)  # top 2 of 8 experts
    assert _tokens(tmp_path, chunked_prefill_size=4096) == 4096 // 2


def test_a_negative_token_count_is_refused(tmp_path):
    save_tiny_model("qwen3", tmp_path)
    with pytest.raises(ConfigError, match="--prefill-cuda-graph-max-tokens=-1 must be >= 0"):
        _tokens(tmp_path, prefill_cuda_graph_max_tokens=-1)
