"""A decode batch of LONGEST_FIRST_FROM requests or more runs longest context first (a shorter
tail for the decode attention grid), and the order changes no request's output."""

from __future__ import annotations

import pytest

from minfer import LLM, SamplingParams
from minfer.scheduler import decode

NUM_REQUESTS = decode.LONGEST_FIRST_FROM + 4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from tiny_models import save_tiny_model

    path = tmp_path_factory.mktemp("tiny-decode-order")
    save_tiny_model("qwen2", path)
    return str(path)


def _prompt(i: int) -> list[int]:
    # lengths 5..39 in a scrambled order, so admission order is not length order
    length = 5 + (i * 13) % NUM_REQUESTS
    return [(11 * i + 3 * k) % 250 + 1 for k in range(length)]


def _params(i: int) -> SamplingParams:
    """Per-row sampling state that a reordered batch must carry with its request: seeded
    temperature sampling, penalties, a min_tokens ban, and different lengths."""
    if i % 3 == 0:
        return SamplingParams(temperature=0, max_tokens=6 + i % 5, ignore_eos=True, logprobs=2)
    if i % 3 == 1:
        return SamplingParams(temperature=0.9, top_p=0.8, seed=i, max_tokens=7, ignore_eos=True)
    return SamplingParams(
        temperature=0.7,
        seed=100 + i,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        min_tokens=3,
        max_tokens=5,
    )


def _llm(model_path: str, overlap: bool = True) -> LLM:
    return LLM(
        model_path,
        kv_cache_tokens=4096,
        max_running_requests=64,
        check_kv_invariants=True,
        disable_overlap_schedule=not overlap,
    )


def test_decode_batch_runs_longest_first_and_running_keeps_admission_order(model_path):
    llm = _llm(model_path)
    sched = llm.scheduler
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    admitted = [sched.add_request(_prompt(i), params) for i in range(NUM_REQUESTS)]
    for _ in range(50):
        if len(sched.running) == NUM_REQUESTS:
            break
        sched.step()
    assert len(sched.running) == NUM_REQUESTS
    assert [r.uid for r in sched.running] == [r.uid for r in admitted]  # preemption goes by it

    batch = sched.decode.plan()
    lengths = [r.device_len for r in batch.reqs]
    assert lengths == sorted(lengths, reverse=True)
    assert lengths != [r.device_len for r in admitted]  # the test's prompts do need reordering
    assert [r.uid for r in sched.running] == [r.uid for r in admitted]


@pytest.mark.parametrize("overlap", [True, False])
def test_order_changes_no_output(model_path, monkeypatch, overlap):
    prompts = [_prompt(i) for i in range(NUM_REQUESTS)]
    params = [_params(i) for i in range(NUM_REQUESTS)]
    sorted_run = _llm(model_path, overlap).generate_ids(prompts, params, use_tqdm=False)
    monkeypatch.setattr(decode, "LONGEST_FIRST_FROM", 10**9)
    admission_run = _llm(model_path, overlap).generate_ids(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in sorted_run] == [o.token_ids for o in admission_run]
    with_logprobs = [(a, b) for a, b in zip(sorted_run, admission_run) if a.logprobs is not None]
    assert with_logprobs
    for ours, theirs in with_logprobs:  # the chosen tokens' and the top-2 log-probs, row by row
        assert ours.logprobs.top_ids == theirs.logprobs.top_ids
        assert ours.logprobs.logprobs == pytest.approx(theirs.logprobs.logprobs, abs=1e-5)
        for a, b in zip(ours.logprobs.top_logprobs, theirs.logprobs.top_logprobs):
            assert a == pytest.approx(b, abs=1e-5)
    assert len({tuple(o.token_ids) for o in sorted_run}) > NUM_REQUESTS // 2  # not one repeated answer
