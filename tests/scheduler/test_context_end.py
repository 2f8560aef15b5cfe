"""Requests that run to the end of the context (prompt + max_tokens up to max_model_len, the most
allowed) under overlap scheduling, chunked prefill, preemption and pages of several tokens: each
gets every token it asked for, the same tokens as alone (greedy)."""

from __future__ import annotations

import random

import pytest
from tiny_models import save_tiny_model

from minfer import LLM, SamplingParams

CONTEXT = 48


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-context-end")
    save_tiny_model("qwen2", path)
    return str(path)


def workload(seed: int = 1, count: int = 24):
    """Prompts of 1 to CONTEXT - 1 tokens, each with a max_tokens that at most fills the context
    (half of them exactly)."""
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(count):
        n = rng.randint(1, CONTEXT - 1)
        prompts.append([rng.randrange(256) for _ in range(n)])
        room = CONTEXT - n
        params.append(
            SamplingParams(temperature=0, max_tokens=room if i % 2 else rng.randint(1, room), ignore_eos=True)
        )
    return prompts, params


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"disable_overlap_schedule": True},
        {"kv_cache_tokens": 160, "chunked_prefill_size": 8},  # preempts
        {"kv_cache_tokens": 128, "page_size": 4},
    ],
)
def test_requests_at_the_end_of_the_context_get_every_token(model_path, options):
    prompts, params = workload()
    alone = LLM(
        model_path,
        max_model_len=CONTEXT,
        kv_cache_tokens=512,
        disable_overlap_schedule=True,
        log_level="warning",
    )
    expected = [alone.generate_ids([p], sp, use_tqdm=False)[0].token_ids for p, sp in zip(prompts, params)]
    llm = LLM(model_path, max_model_len=CONTEXT, log_level="warning", **{"kv_cache_tokens": 512, **options})
    outs = llm.generate_ids(prompts, params, use_tqdm=False)
    for out, want, sp in zip(outs, expected, params):
        assert len(out.token_ids) == sp.max_tokens and out.finish_reason == "length"
        assert out.token_ids == want
