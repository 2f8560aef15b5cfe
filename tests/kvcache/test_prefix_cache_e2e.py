"""End to end through the engine: the radix cache and preemption change speed, never tokens."""

from __future__ import annotations

import random

import pytest

from minfer import LLM, SamplingParams
from minfer.core import InvalidRequestError


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from tiny_models import save_tiny_model

    path = tmp_path_factory.mktemp("tiny-prefix")
    save_tiny_model("qwen2", path)
    return str(path)


def _shared_prefix_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(256) for _ in range(40)] for _ in range(3)]
    return [systems[i % 3] + [rng.randrange(256) for _ in range(rng.randint(3, 20))] for i in range(n)]


def _free_or_cached(llm) -> bool:
    kv = llm.scheduler.kv
    return kv.allocator.num_free_pages + kv.prefix_cache.cached_pages == kv.num_pages


# fp8_e4m3: cached prefixes and recomputed (preempted) requests read what a fresh run reads
@pytest.mark.parametrize("page_size,kv_cache_dtype", [(1, "auto"), (4, "auto"), (4, "fp8_e4m3")])
def test_tiny_pool_preempts_and_evicts_but_matches_huge_pool(model_path, page_size, kv_cache_dtype):
    prompts = _shared_prefix_prompts(24)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    kv = dict(page_size=page_size, kv_cache_dtype=kv_cache_dtype)
    reference = LLM(model_path, kv_cache_tokens=8192, cache="naive", **kv)
    expected = [o.token_ids for o in reference.generate(prompts, params, use_tqdm=False)]

    # 160 slots: far too few for 24 requests of ~55-90 tokens each.
    small = LLM(model_path, kv_cache_tokens=160, chunked_prefill_size=64, **kv)
    got = [o.token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    sched = small.scheduler
    assert sched.counters.preemptions > 0
    assert sched.kv.prefix_cache.counters.evicted_pages > 0
    assert sched.kv.prefix_cache.counters.hit_tokens > 0
    assert _free_or_cached(small)


def test_identical_request_hits_whole_prompt_but_last_token(model_path):
    llm = LLM(model_path, kv_cache_tokens=1024)
    prompt = list(range(30, 67))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    counters = llm.scheduler.kv.prefix_cache.counters
    hits_before, queried_before = counters.hit_tokens, counters.queried_tokens
    second = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    assert second == first
    assert counters.hit_tokens - hits_before == len(prompt) - 1
    assert counters.queried_tokens - queried_before == len(prompt) - 1


def test_chat_turn_extending_a_conversation_hits(model_path):
    llm = LLM(model_path, kv_cache_tokens=1024)
    turn1 = list(range(10, 50))
    out = llm.generate([turn1], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[
        0
    ]
    turn2 = turn1 + out.token_ids + [7, 8, 9]
    counters = llm.scheduler.kv.prefix_cache.counters
    before = counters.hit_tokens
    llm.generate([turn2], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    # Everything the first turn computed K/V for: prompt + all outputs but the last one.
    assert counters.hit_tokens - before == len(turn1) + len(out.token_ids) - 1


def test_lpm_policy_same_tokens(model_path):
    prompts = _shared_prefix_prompts(12, seed=3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    fcfs = LLM(model_path, kv_cache_tokens=2048).generate(prompts, params, use_tqdm=False)
    lpm = LLM(model_path, kv_cache_tokens=2048, schedule_policy="lpm").generate(
        prompts, params, use_tqdm=False
    )
    assert [o.token_ids for o in lpm] == [o.token_ids for o in fcfs]


def test_request_larger_than_pool_is_rejected(model_path):
    llm = LLM(model_path, kv_cache_tokens=64)
    with pytest.raises(InvalidRequestError, match="KV pool"):
        llm.generate([list(range(60))], SamplingParams(max_tokens=10))
