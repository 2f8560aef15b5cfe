"""Token-exact greedy parity with transformers for each architecture, through the real loader."""

from __future__ import annotations

import random

import pytest
import torch
from greedy_parity import assert_greedy_parity, near_tie_gap
from tiny_models import hf_greedy

from minfer import LLM, SamplingParams


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("page_size,overlap", [(1, True), (16, False)])
def test_greedy_matches_transformers(tiny_model, page_size, overlap):
    arch, path, hf = tiny_model
    # 70 tokens with a 24-token chunk budget: the long prompt spans three prefill steps.
    prompts = _prompts(1, [5, 70, 17, 1, 33])
    max_tokens = 12
    expected = [hf_greedy(hf, p, max_tokens) for p in prompts]
    llm = LLM(
        path,
        page_size=page_size,
        chunked_prefill_size=24,
        kv_cache_tokens=1024,
        disable_overlap_schedule=not overlap,
    )
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False
    )
    for prompt, out, exp in zip(prompts, outs, expected):
        # identical, or first apart at a float near-tie of the reference (tests/greedy_parity.py)
        assert_greedy_parity(hf, prompt, out.token_ids, exp, near_tie_gap(llm.engine.dtype))
        assert out.finish_reason == "length"
    # Every slot went back to the allocator (the naive part) or the prefix cache.
    kv = llm.scheduler.kv
    assert kv.allocator.num_free_pages + kv.prefix_cache.cached_pages == kv.num_pages


def test_single_stream_matches_transformers(tiny_model):
    """One request decoding alone: on a GPU its GEMMs are one-row products (minfer.kernels.gemv,
    started early by programmatic dependent launch), the path of a batch-1 decode step."""
    arch, path, hf = tiny_model
    prompt = _prompts(2, [29])[0]
    expected = hf_greedy(hf, prompt, 16)
    # bf16 on a GPU: gemv takes only half types (float32 stays on torch's matmul)
    llm = LLM(path, kv_cache_tokens=256, **({"dtype": "bfloat16"} if torch.cuda.is_available() else {}))
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )[0]
    assert_greedy_parity(hf, prompt, out.token_ids, expected, near_tie_gap(llm.engine.dtype))
