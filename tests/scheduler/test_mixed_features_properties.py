"""Property test: requests that mix sampling features (seeded temperatures, top-k / top-p /
min-p, the three penalties, logit_bias, min_tokens, stop strings, bad words, allowed tokens,
structured output, logprobs and prompt logprobs) give the same output run together in a small KV
pool -- preempted and recomputed, prefilled in chunks, their shared heads found in the prefix
cache, overlap scheduling on -- as in a pool large enough for all of them at once, without a
prefix cache (so also in other batch compositions).

Everything a request carries across a preemption or a prefix hit is covered: penalty counts,
its seed's position, the grammar's state, min_tokens, the stop-string scan, the logprobs so
far. The page invariant is checked after every step (MINFER_CHECK_KV_INVARIANTS, set by
conftest). The requests are drawn from a seeded random generator, so a failure names its seed
and reproduces."""

from __future__ import annotations

import random

import pytest

from minfer import LLM, SamplingParams
from minfer.core import RequestOutput, StructuredOutput

NUM_REQUESTS = 24
WORDS = [
    "the",
    "cat",
    "dog",
    "sat",
    "on",
    "a",
    "mat",
    "and",
    "ran",
    "far",
    "away",
    "into",
    "rain",
    "snow",
    "river",
]
GRAMMARS = [("regex", "(cat|dog)( (cat|dog))*"), ("regex", "[a-z ]{3,30}"), ("json", "")]
# The mixed run's pool: 11 pages of 16 tokens, 10 of them for one request alone (one is the
# decode reserve), about what the longest request (~100 prompt + 48 output tokens) needs: the 24
# requests preempt one another.
SMALL_POOL_TOKENS = 176
# A token's rank counts the vocabulary entries above its logprob. Deep in this random model's flat
# distribution (49,152 entries within a few nats) neighbours sit ~1e-5 nats apart, and a batch
# of other rows rounds a logprob ~1e-6 differently (the products' summation order), which moved a
# rank of ~36,000 by one; a wrong cache moves logprobs by far more than the 1e-4 checked above.
RANK_SLACK = 2


def draw_params(rng: random.Random) -> SamplingParams:
    kw: dict = {"max_tokens": rng.randint(1, 48), "ignore_eos": rng.random() < 0.7}
    if rng.random() < 0.5:
        kw["temperature"] = 0
    else:
        kw.update(temperature=rng.choice([0.5, 1.0, 1.5]), seed=rng.randint(0, 1000))
        if rng.random() < 0.3:
            kw["top_k"] = rng.choice([1, 5, 50])
        if rng.random() < 0.3:
            kw["top_p"] = rng.choice([0.5, 0.9])
        if rng.random() < 0.2:
            kw["min_p"] = 0.05
    if rng.random() < 0.3:
        kw["presence_penalty"] = rng.choice([-1.0, 0.5, 1.5])
    if rng.random() < 0.3:
        kw["frequency_penalty"] = rng.choice([0.5, 1.0])
    if rng.random() < 0.3:
        kw["repetition_penalty"] = rng.choice([1.2, 0.8])
    if rng.random() < 0.2:
        kw["logit_bias"] = {rng.randint(0, 1000): rng.choice([-100.0, 5.0])}
    if rng.random() < 0.2:
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
    if rng.random() < 0.2:
        kw["stop"] = [rng.choice(["e", "a", "the", "."])]
    if rng.random() < 0.3:
        kw["logprobs"] = rng.choice([0, 1, 3])
    if rng.random() < 0.2:
        kw["prompt_logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.1:
        kw["bad_words"] = ["the"]
    if rng.random() < 0.1:
        kw["allowed_token_ids"] = rng.sample(range(1000), 30)
    if rng.random() < 0.15:
        kw["structured_output"] = StructuredOutput(*rng.choice(GRAMMARS))
    return SamplingParams(**kw)


def draw_workload(seed: int) -> tuple[list[str], list[SamplingParams]]:
    """Prompts of 1-60 words, 60% of them behind one of two 40-word heads (prefix hits)."""
    rng = random.Random(seed)
    heads = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(2)]
    prompts = []
    for _ in range(NUM_REQUESTS):
        tail = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))
        prompts.append(f"{rng.choice(heads)} {tail}" if rng.random() < 0.6 else tail)
    return prompts, [draw_params(rng) for _ in range(NUM_REQUESTS)]


def differences(alone: RequestOutput, mixed: RequestOutput) -> list[str]:
    found = [
        f"{name}: {getattr(alone, name)!r} alone, {getattr(mixed, name)!r} mixed"
        for name in ("token_ids", "finish_reason", "text")
        if getattr(alone, name) != getattr(mixed, name)
    ]
    for name in ("logprobs", "prompt_logprobs"):
        a, b = getattr(alone, name), getattr(mixed, name)
        if (a is None) != (b is None):
            found.append(f"{name} given {a is not None} alone, {b is not None} mixed")
        elif a is not None and (a.token_ids, a.top_ids) != (b.token_ids, b.top_ids):
            found.append(f"{name}: other tokens or top tokens")
        elif a is not None and a.logprobs != pytest.approx(b.logprobs, abs=1e-4):
            found.append(f"{name}: {a.logprobs} alone, {b.logprobs} mixed")
        elif a is not None and any(
            abs(x - y) > RANK_SLACK for x, y in zip(a.ranks, b.ranks) if x is not None
        ):
            found.append(f"{name}: ranks {a.ranks} alone, {b.ranks} mixed")
    return found


@pytest.fixture(scope="module")
def model_path(tiny_chat_model):
    return tiny_chat_model


@pytest.mark.parametrize(
    "seed, options",
    [
        (0, {}),
        (1, {"kv_cache_dtype": "fp8_e4m3"}),  # the reference's pool is fp8 too
        (2, {"host_kv_cache_gb": 0.01}),  # evicted heads come back from the host tier
    ],
)
def test_mixed_features_survive_preemption_and_prefix_hits(model_path, seed, options):
    prompts, params = draw_workload(seed)
    reference = LLM(
        model_path,
        kv_cache_tokens=8192,
        cache="naive",
        disable_overlap_schedule=True,
        log_level="warning",
        kv_cache_dtype=options.get("kv_cache_dtype", "auto"),
    )
    alone = reference.generate(prompts, params, use_tqdm=False)  # all running at once, never preempted
    llm = LLM(
        model_path,
        kv_cache_tokens=SMALL_POOL_TOKENS,
        page_size=16,
        chunked_prefill_size=64,
        log_level="warning",
        **options,
    )
    for run in range(2):  # the second run starts with the first one's prefixes cached
        mixed = llm.generate(prompts, params, use_tqdm=False)
        wrong = {i: d for i, (a, b) in enumerate(zip(alone, mixed)) if (d := differences(a, b))}
        assert not wrong, "\n".join(
            f"seed {seed} run {run} request {i} {params[i]}: {d}" for i, d in wrong.items()
        )
    assert llm.scheduler.counters.preemptions > 0  # the premise: the pool was too small for all
