"""Request state follows docs/ARCHITECTURE.md exactly: 0/3/3 -> 3/4/1 -> 4/5/1, and every slot comes back."""

from __future__ import annotations

import pytest

from minfer import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from tiny_models import save_tiny_model

    path = tmp_path_factory.mktemp("tiny-state")
    save_tiny_model("llama", path)
    # Without overlap, each step's tokens are read in the same step: lengths can be checked per step.
    return LLM(str(path), kv_cache_tokens=256, chunked_prefill_size=64, disable_overlap_schedule=True)


def test_three_lengths_through_prefill_and_decode(llm):
    sched = llm.scheduler
    req = sched.add_request([11, 12, 13], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert (req.cached_len, req.device_len, req.extend_len) == (0, 3, 3)
    free_before = sched.kv.allocator.num_free_pages
    sched.step()  # prefill A B C, sample D
    assert (req.cached_len, req.device_len, req.extend_len) == (3, 4, 1)
    assert sched.kv.allocator.num_free_pages == free_before - 3
    sched.step()  # decode D, sample E
    assert (req.cached_len, req.device_len, req.extend_len) == (4, 5, 1)
    assert sched.kv.allocator.num_free_pages == free_before - 4
    outs = sched.step()  # decode E, sample F: max_tokens reached
    assert outs[0].finish_reason == "length"
    # The last sampled token F never got a slot: cached = prompt + output - 1.
    assert (req.cached_len, req.device_len) == (3 + 3 - 1, 3 + 3)
    kv = sched.kv
    assert kv.allocator.num_free_pages + kv.prefix_cache.cached_pages == kv.num_pages
    assert not sched.has_work


def test_chunked_prefill_spans_steps(llm):
    sched = llm.scheduler
    sched.config.chunked_prefill_size = 8
    try:
        req = sched.add_request(list(range(20)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        seen = []
        while sched.has_work:
            sched.step()
            seen.append((req.cached_len, req.device_len))
        cached_hit = sched.kv.prefix_cache.counters.hit_tokens
    finally:
        sched.config.chunked_prefill_size = 64
    assert seen[:3] == [(8, 20), (16, 20), (20, 21)]
    assert seen[-1] == (21, 22)
    assert cached_hit >= 0


def test_all_slots_return_after_many_requests(llm):
    prompts = [[i, i + 1, i + 2, i + 3] * (i % 5 + 1) for i in range(12)]
    llm.generate(prompts, SamplingParams(temperature=0.8, max_tokens=9, ignore_eos=True), use_tqdm=False)
    kv = llm.scheduler.kv
    assert kv.allocator.num_free_pages + kv.prefix_cache.cached_pages == kv.num_pages
    assert kv.page_table.num_free_rows == kv.page_table.max_rows


def test_overlap_final_state_and_slots(tmp_path):
    """With overlap, a request that stops on a stop token was already in the next pass; that
    pass's slot is returned and the final state is still prompt + output - 1."""
    from tiny_models import save_tiny_model

    save_tiny_model("llama", tmp_path)
    llm = LLM(str(tmp_path), kv_cache_tokens=256, cache="naive")
    sched = llm.scheduler
    probe = llm.generate(
        [[3, 4, 5]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )
    stop_at = probe[0].token_ids[2]
    req = sched.add_request([3, 4, 5], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop_at]))
    while sched.has_work:
        sched.step()
    assert req.finish_reason == "stop" and req.output_ids == probe[0].token_ids[:3]
    assert (req.cached_len, req.device_len) == (3 + 3 - 1, 3 + 3)
    assert sched.kv.allocator.num_free_pages == sched.kv.num_pages
