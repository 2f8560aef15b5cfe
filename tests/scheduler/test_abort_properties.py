"""Property test: random sequences of add / step / abort / evict against the page invariant
(checked after every operation) and against outputs (a finished request's greedy tokens are the
ones it gets alone, whatever was aborted, evicted or preempted around it)."""

from __future__ import annotations

import functools

import pytest
import split_page_table
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minfer import LLM, SamplingParams

MAX_TOKENS = 8
SYSTEMS = [[(13 * i + k) % 256 for i in range(24)] for k in (1, 2)]  # shared heads: prefix hits
PROMPTS = [
    SYSTEMS[k % 2][: 12 + 6 * (k % 3)] + [(k * 31 + j) % 256 for j in range(3 + 4 * k)] for k in range(6)
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from tiny_models import save_tiny_model

    path = tmp_path_factory.mktemp("tiny-abort-props")
    save_tiny_model("qwen2", path)
    return str(path)


@functools.cache
def solo_output(model_path: str, page_size: int, prompt_idx: int) -> tuple[int, ...]:
    llm = LLM(
        model_path,
        kv_cache_tokens=1024,
        page_size=page_size,
        cache="naive",
        disable_overlap_schedule=True,
        log_level="warning",
    )
    out = llm.generate(
        [PROMPTS[prompt_idx]],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    return tuple(out[0].token_ids)


def expected_output(solo: tuple[int, ...], max_tokens: int, stop_at: int | None) -> tuple[list[int], str]:
    """Tokens and finish reason of a request whose alone-output is `solo`; the stop token is the
    one `solo` has at position `stop_at` (it may occur earlier too)."""
    out = list(solo[:max_tokens])
    if stop_at is not None and solo[stop_at] in out:
        return out[: out.index(solo[stop_at]) + 1], "stop"
    return out, "length"


add = st.tuples(
    st.just("add"),
    st.integers(0, len(PROMPTS) - 1),
    st.integers(1, MAX_TOKENS),
    st.integers(1, 3),
    st.one_of(st.none(), st.integers(0, MAX_TOKENS - 1)),
)
step = st.tuples(st.just("step"), st.integers(1, 4))
# Abort any unfinished request, or one of the batch whose pass is in flight (overlap mode): the
# moment when its tokens are on the device but not yet on the CPU.
abort = st.tuples(st.sampled_from(["abort", "abort_in_flight"]), st.integers(0, 1000))
evict = st.tuples(st.just("evict"), st.integers(1, 16))
engine_options = st.fixed_dictionaries(
    {
        "disable_overlap_schedule": st.booleans(),
        "page_size": st.sampled_from([1, 2, 4]),
        "chunked_prefill_size": st.sampled_from([8, 16, 64]),
        "kv_cache_tokens": st.sampled_from([96, 160, 512]),  # the small ones force preemption
        # the page table's device copy apart from its host mirror, as on CUDA (split_page_table)
        "split_mirror": st.booleans(),
    }
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    options=engine_options,
    ops=st.lists(st.one_of(add, add, step, step, abort, evict), min_size=4, max_size=30),
)
def test_random_aborts_keep_pages_and_outputs(model_path, options, ops):
    options = dict(options)
    split = options.pop("split_mirror")
    llm = LLM(model_path, check_kv_invariants=True, log_level="warning", **options)
    if split:
        split_page_table.split_mirror(llm)
    sched = llm.scheduler
    live: dict[int, tuple] = {}  # uid -> (req, prompt index, max_tokens, stop position)
    aborted: set[int] = set()
    for op in ops:
        if op[0] == "add":
            _, idx, max_tokens, copies, stop_at = op
            stop = [] if stop_at is None else [solo_output(model_path, options["page_size"], idx)[stop_at]]
            for _ in range(copies):  # n > 1: copies of one prompt
                params = SamplingParams(
                    temperature=0, max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stop
                )
                req = sched.add_request(PROMPTS[idx], params)
                live[req.uid] = (req, idx, max_tokens, stop_at)
        elif op[0] == "step":
            for _ in range(op[1]):
                sched.step()
        elif op[0] in ("abort", "abort_in_flight"):
            if op[0] == "abort":
                unfinished = [uid for uid, (req, *_) in live.items() if not req.finished]
            else:
                unfinished = [
                    r.uid for r in (sched.in_flight[0].reqs if sched.in_flight else []) if not r.finished
                ]
            if unfinished:
                uid = unfinished[op[1] % len(unfinished)]
                assert sched.abort(uid) is not None
                aborted.add(uid)
        else:
            sched.kv.prefix_cache.evict(op[1])
        sched.check_invariants()
    while sched.has_work:
        sched.step()
    sched.check_invariants()
    for uid, (req, idx, max_tokens, stop_at) in live.items():
        if uid in aborted:
            assert req.finish_reason == "abort"
            continue
        want, reason = expected_output(
            solo_output(model_path, options["page_size"], idx), max_tokens, stop_at
        )
        assert (req.output_ids, req.finish_reason) == (want, reason), f"request {uid} (prompt {idx})"
    kv = sched.kv
    assert kv.used_pages == 0 and not sched.by_uid
    assert kv.allocator.num_free_pages + kv.prefix_cache.cached_pages == kv.num_pages
