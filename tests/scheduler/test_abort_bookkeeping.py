"""Aborts at any moment leave every KV page owned exactly once, and never change other outputs.

The regression: a request aborted while the pass computing its prompt was in flight (overlap
mode) had already handed its prompt to the prefix cache; the release path freed the last prompt
page anyway, the cache freed it again on eviction, and later requests read K/V that another
request had overwritten.
"""

from __future__ import annotations

import pytest

from minfer import LLM, SamplingParams
from minfer.kvcache.prefix_cache import KVInvariantError

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from tiny_models import save_tiny_model

    path = tmp_path_factory.mktemp("tiny-abort")
    save_tiny_model("qwen2", path)
    return str(path)


def _llm(model_path, overlap: bool, page_size: int, **kw) -> LLM:
    return LLM(
        model_path,
        kv_cache_tokens=kw.pop("kv_cache_tokens", 256),
        page_size=page_size,
        disable_overlap_schedule=not overlap,
        check_kv_invariants=True,
        **kw,
    )


def _run(llm: LLM, prompt: list[int]) -> list[int]:
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("prompt_len", [36, 37])
@pytest.mark.parametrize("abort_after_steps", [1, 2, 3])
def test_abort_during_prefill_keeps_pages_and_outputs(
    model_path, overlap, page_size, prompt_len, abort_after_steps
):
    prompt = [(7 * i + 3) % 256 for i in range(prompt_len)]
    follow_up = prompt + [42]
    unrelated = [[(5 * i + k) % 256 for i in range(30)] for k in range(3)]
    fresh = _run(_llm(model_path, overlap, page_size), follow_up)

    # A small pool and small chunks: the prompt spans steps, and the unrelated requests evict.
    llm = _llm(model_path, overlap, page_size, kv_cache_tokens=128, chunked_prefill_size=16)
    sched = llm.scheduler
    req = sched.add_request(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for _ in range(abort_after_steps):
        sched.step()
    sched.abort(req.uid)
    sched.check_invariants()
    for p in unrelated:
        _run(llm, p)
    assert _run(llm, follow_up) == fresh
    kv = sched.kv
    while sched.has_work:  # drain a pass still in flight
        sched.step()
    assert kv.allocator.num_free_pages + kv.prefix_cache.cached_pages == kv.num_pages
    assert kv.used_pages == 0


def test_mass_abort_of_n_times_prompts_during_prefill(model_path):
    """The server reproduction in miniature: 64 prompts x 2 copies, all aborted mid-prefill."""
    llm = _llm(model_path, True, 1, kv_cache_tokens=2048, chunked_prefill_size=64)
    sched = llm.scheduler
    probe = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    before = _run(llm, probe)
    uids = [
        sched.add_request([100 + i % 50, 3, i % 7 + 1], SamplingParams(temperature=0, max_tokens=1)).uid
        for i in range(128)
    ]
    sched.step()
    sched.step()
    for uid in uids:
        sched.abort(uid)
    sched.check_invariants()
    assert _run(llm, probe) == before
    assert sched.kv.used_pages == 0


def test_check_catches_a_double_owned_page(model_path):
    """The check itself: a page handed to the free list while the tree owns it is reported."""
    llm = _llm(model_path, True, 1)
    _run(llm, list(range(20)))
    kv = llm.scheduler.kv
    llm.scheduler.check_invariants()
    tree_page = kv.prefix_cache.audit([])[0]
    kv.allocator.free([tree_page])
    with pytest.raises(KVInvariantError, match=f"page {tree_page} is owned twice"):
        llm.scheduler.check_invariants()
