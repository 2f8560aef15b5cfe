"""Traced offline runs shared by the trace tests: a tiny model, and a workload that exercises
every path of a request's life (chunked prefill, prefix hits, abort, preemption, stop tokens)."""

from __future__ import annotations

import random

from minfer import LLM, SamplingParams
from minfer.observability.trace import read_trace


def traced_llm(model_path: str, trace_path, **options) -> LLM:
    return LLM(model_path, trace_requests=str(trace_path), **options)


def finish_trace(llm: LLM, trace_path) -> list[dict]:
    llm.scheduler.tracer.close()
    return read_trace(str(trace_path))


def run_mixed_workload(llm: LLM, num_requests: int = 24, seed: int = 0) -> dict:
    """Queue many requests at once, abort one mid-run, add two identical prompts later; returns
    what happened (uids by kind) so tests can assert the paths were really taken."""
    sched = llm.scheduler
    rng = random.Random(seed)
    shared = [rng.randrange(3, 250) for _ in range(40)]
    reqs = []
    for i in range(num_requests):
        prompt = shared[: 8 + (i * 7) % 30] + [rng.randrange(3, 250) for _ in range(rng.randrange(1, 30))]
        params = SamplingParams(
            temperature=0.0 if i % 3 == 0 else 0.8, max_tokens=rng.randrange(1, 20), ignore_eos=True, seed=i
        )
        if i % 4 == 1:  # stop tokens end these early, and with overlap one pass past the end
            params.stop_token_ids = list(range(3, 256, 9))
        reqs.append(sched.add_request(prompt, params))
    aborted = reqs[3].uid
    steps = 0
    while sched.has_work:
        sched.step()
        steps += 1
        if steps == 5:
            sched.abort(aborted)
        if steps == 8:  # the same prompt twice: the second hits the first's prefix
            for _ in range(2):
                reqs.append(sched.add_request(shared[:30], SamplingParams(temperature=0, max_tokens=5)))
    return {
        "aborted": aborted,
        "steps": steps,
        "preemptions": sched.counters.preemptions,
        "hit_tokens": sched.kv.prefix_cache.counters.hit_tokens,
        "reasons": {r.uid: r.finish_reason for r in reqs},
    }
