"""The host KV tier: pages round-trip bit for bit, and multi-turn conversations on a device pool
of ~25% of their working set hit their whole history with the tier, with unchanged outputs."""

from __future__ import annotations

import pytest
import torch

from minfer import LLM, SamplingParams
from minfer.config import ConfigError
from minfer.kvcache.allocator import PageAllocator
from minfer.kvcache.host_pool import HostKVPool
from minfer.kvcache.host_tier import HostTier, copy_runs
from minfer.kvcache.pool import KVPool
from minfer.kvcache.tiered_radix import TieredRadixCache
from minfer.observability.trace_check import check_file, format_report

PS = 4


def make_cache(device_pages: int, host_pages: int, dtype=torch.float32, write_policy="write_back"):
    pool = KVPool(2, device_pages * PS, 2, 8, PS, dtype, torch.device("cpu"))
    host = HostKVPool(pool, host_pages * PS, PS, pin=False)
    cache = TieredRadixCache(PageAllocator(device_pages, PS), HostTier(pool, host), write_policy)
    return pool, cache


def fill(pool: KVPool, slots: list[int], seed: int) -> None:
    """Write distinct raw rows (any dtype, through its bytes) at `slots` of every layer."""
    gen = torch.Generator().manual_seed(seed)
    for t in (*pool.k, *pool.v):
        rows = t[slots].view(torch.uint8)
        t.view(torch.uint8)[slots] = torch.randint(0, 255, rows.shape, generator=gen, dtype=torch.uint8)


def rows(pool: KVPool, slots: list[int]) -> list[torch.Tensor]:
    """The raw bytes (random bytes make NaNs of float rows, which never compare equal)."""
    return [t[slots].view(torch.uint8).clone() for t in (*pool.k, *pool.v)]


def test_copy_runs_pairs_consecutive_slots():
    assert copy_runs([0, 1, 2, 8, 9], [4, 5, 6, 7, 8]) == [(0, 4, 3), (8, 7, 2)]
    assert copy_runs([], []) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])  # uint8 stands for a raw low-bit cache
def test_evicted_prefix_comes_back_bit_for_bit(dtype):
    pool, cache = make_cache(device_pages=4, host_pages=8, dtype=dtype)
    tokens = list(range(16))  # 4 pages: the whole device pool
    slots = [p * PS + i for p in cache.allocator.alloc(4) for i in range(PS)]
    fill(pool, slots, seed=1)
    want = rows(pool, slots)
    cache.insert(tokens, slots, None)
    assert cache.evict(4) == 4 and cache.cached_pages == 0 and cache.host_pages == 4
    other = [p * PS + i for p in cache.allocator.alloc(4) for i in range(PS)]
    fill(pool, other, seed=2)  # the device pages are reused and overwritten
    cache.allocator.free(cache.allocator.pages_of_slots(other))
    match = cache.match(tokens + [99])
    assert len(match.slots) == 16 and match.load is None  # CPU: loaded synchronously
    assert all(torch.equal(a, b) for a, b in zip(rows(pool, match.slots), want))
    assert cache.tier.counters.tokens_loaded == 16 and cache.tier.counters.hits == 1
    cache.audit([match.handle])
    cache.release(match.handle)
    cache.audit([])


def test_one_eviction_writes_back_every_node_in_one_transfer():
    """Three nodes (a shared head and two branches) evicted by one call: one offload, whose
    pages all come back bit for bit."""
    pool, cache = make_cache(device_pages=6, host_pages=8)
    head, left, right = list(range(8)), [50, 51, 52, 53], [60, 61, 62, 63]
    want = {}
    for tokens in (head + left, head + right):
        match = cache.match(tokens)
        own = [
            p * PS + i
            for p in cache.allocator.alloc((len(tokens) - len(match.slots)) // PS)
            for i in range(PS)
        ]
        fill(pool, own, seed=len(want))
        cache.insert(tokens, match.slots + own, match.handle)
        want[tuple(tokens)] = rows(pool, match.slots + own)
    assert sum(1 for _ in cache._nodes()) == 3
    assert cache.evict(4) == 4 and cache.tier.counters.offload_copies == 1  # one transfer
    cache.audit([])
    for tokens, expected in want.items():
        match = cache.match(list(tokens) + [99])
        assert all(torch.equal(a, b) for a, b in zip(rows(pool, match.slots), expected))
        cache.release(match.handle)
        cache.evict(4)
    cache.audit([])


def test_match_cost_prices_a_match_without_making_it():
    from minfer.kvcache.match_cost import match_cost

    pool, cache = make_cache(device_pages=6, host_pages=8)
    head, tail = list(range(8)), list(range(50, 58))  # two pages each
    cache.insert(head + tail, [p * PS + i for p in cache.allocator.alloc(4) for i in range(PS)], None)
    cache.evict(2)  # `tail` goes to the host; `head` stays on the device, unlocked
    # head unlocked (2 pages become locked) + the first page of tail on the host only (1 free page)
    assert match_cost(cache, head + tail[:4] + [99]) == (12, 3)
    assert cache.tier.counters.hits == 0 and sum(1 for _ in cache._nodes()) == 2  # no load, no split
    held = cache.match(head + [99])
    assert match_cost(cache, head + tail) == (16, 2)  # head is locked by another request: free
    available = cache.allocator.num_free_pages + cache.evictable_pages
    match = cache.match(head + tail[:4] + [99])  # what the match really takes matches the price
    assert len(match.slots) == 12
    assert available - (cache.allocator.num_free_pages + cache.evictable_pages) == 1
    cache.release(match.handle)
    cache.release(held.handle)
    cache.audit([])


def test_host_eviction_is_lru_and_drops_for_good():
    pool, cache = make_cache(device_pages=2, host_pages=2)
    for k in range(3):  # three two-page prefixes through a two-page device pool
        tokens = [100 * k + i for i in range(8)]
        if cache.allocator.num_free_pages < 2:
            cache.evict(2)
        slots = [p * PS + i for p in cache.allocator.alloc(2) for i in range(PS)]
        cache.insert(tokens, slots, None)
        cache.audit([])
    cache.evict(2)  # the third moves to the host, which drops the first (least recent) for good
    cache.audit([])
    assert cache.prefix_length([0, 1, 2, 3, 4, 5, 6, 7]) == 0
    assert cache.prefix_length([200 + i for i in range(8)]) == 8
    assert cache.host_pages == 2 and cache.cached_pages == 0


def test_write_through_copies_on_the_second_hit_and_eviction_only_frees():
    pool, cache = make_cache(device_pages=4, host_pages=8, write_policy="write_through")
    tokens = list(range(8))
    slots = [p * PS + i for p in cache.allocator.alloc(2) for i in range(PS)]
    fill(pool, slots, seed=1)
    want = rows(pool, slots)
    cache.insert(tokens, slots, None)
    offloaded = []
    for _ in range(3):
        match = cache.match(tokens + [99])
        assert match.slots == slots  # on the device all along
        offloaded.append(cache.tier.counters.tokens_offloaded)
        cache.audit([match.handle])
        cache.release(match.handle)
    assert offloaded == [0, 8, 8] and cache.host_pages == 2  # copied once, on the second hit
    assert cache.written_through == set(
        cache.host_allocator.pages_of_slots(cache._root.children[(0, 1, 2, 3)].host_slots)
    )
    assert cache.evict(2) == 2 and cache.tier.counters.tokens_offloaded == 8  # no second copy
    assert not cache.written_through  # announced (kv_offloaded) as its device copy went
    fill(pool, slots, seed=2)  # the device pages are reused
    match = cache.match(tokens + [99])
    assert all(torch.equal(a, b) for a, b in zip(rows(pool, match.slots), want))
    cache.release(match.handle)
    cache.audit([])


def test_write_through_never_drops_a_host_copy_hit_more_often():
    pool, cache = make_cache(device_pages=4, host_pages=2, write_policy="write_through")
    hot, warm = list(range(8)), list(range(100, 108))
    for tokens, hits in ((hot, 3), (warm, 2)):
        if cache.allocator.num_free_pages < 2:
            cache.evict(2)
        cache.insert(tokens, [p * PS + i for p in cache.allocator.alloc(2) for i in range(PS)], None)
        for _ in range(hits):
            cache.release(cache.match(tokens + [99]).handle)
    # `hot` (3 hits) took the whole host tier on its second hit; `warm` (2 hits) may not drop it.
    assert cache.host_pages == 2 and cache.prefix_length(hot) == 8
    assert not cache.host_allocator.num_free_pages and cache.tier.counters.tokens_offloaded == 8
    cache.audit([])


def test_refusals_name_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="host-kv-cache-gb"):
        LLM("qwen3-0.6b", load_format="dummy", host_kv_cache_gb=1.0, cache="naive")
    with pytest.raises(ConfigError, match="host-kv-cache-gb"):
        LLM("qwen3-0.6b", load_format="dummy", host_kv_cache_gb=-1.0)
    with pytest.raises(ConfigError, match="host_kv_write_policy='write_around'"):
        LLM("qwen3-0.6b", load_format="dummy", host_kv_cache_gb=1.0, host_kv_write_policy="write_around")


# -- multi-turn conversations ------------------------------------------------------------------
CONVERSATIONS, ROUNDS, TURN, ANSWER = 6, 4, 24, 16
POOL_TOKENS = 256  # the last round's histories hold 6 x 160 tokens: the pool is ~25% of them


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from tiny_models import save_tiny_model

    path = tmp_path_factory.mktemp("tiny-host-tier")
    save_tiny_model("qwen2", path)
    return str(path)


def converse(model_path, params_of, trace=None, system=(), **options):
    """Every conversation's rounds in turn, each history starting with `system`; returns
    outputs, each round's (prefix hit tokens, whole-history tokens), and the LLM."""
    llm = LLM(
        model_path,
        page_size=PS,
        log_level="warning",
        check_kv_invariants=True,
        trace_requests=trace,
        **options,
    )
    history = [[*system, *((11 * c + j) % 256 for j in range(TURN))] for c in range(CONVERSATIONS)]
    outputs, rounds = [], []
    counters = llm.scheduler.kv.prefix_cache.counters
    for r in range(ROUNDS):
        before = counters.hit_tokens
        # What a round can hit: every earlier token but the last answer's last (it has no K/V).
        whole = sum((len(h) - TURN - 1) // PS * PS for h in history) if r else 0
        res = llm.generate(history, [params_of(r, c) for c in range(CONVERSATIONS)], use_tqdm=False)
        rounds.append((counters.hit_tokens - before, whole))
        for c, out in enumerate(res):
            outputs.append(out.token_ids)
            history[c] = history[c] + out.token_ids + [(7 * c + 3 * r + j) % 256 for j in range(TURN)]
    return outputs, rounds, llm


def greedy(r, c):
    return SamplingParams(temperature=0, max_tokens=ANSWER, ignore_eos=True)


def seeded(r, c):
    return SamplingParams(temperature=0.9, top_p=0.9, seed=100 * r + c, max_tokens=ANSWER, ignore_eos=True)


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
@pytest.mark.parametrize("params_of", [greedy, seeded], ids=["greedy", "seeded"])
def test_multiturn_hits_whole_history_with_host_tier(model_path, params_of, policy, tmp_path):
    # One request at a time: every hit is the request's own history, never cut by a neighbour.
    small = dict(kv_cache_tokens=POOL_TOKENS, max_running_requests=1)
    want, _, _ = converse(model_path, params_of, kv_cache_tokens=4096)  # unconstrained
    without, rounds_without, _ = converse(model_path, params_of, **small)
    trace = tmp_path / "trace.jsonl"
    got, rounds, llm = converse(
        model_path,
        params_of,
        trace=str(trace),
        host_kv_cache_gb=0.01,
        host_kv_write_policy=policy,
        **small,
    )
    assert got == want and without == want
    for r, (hit, whole) in enumerate(rounds):
        if r >= 1:
            assert hit == whole, f"round {r}: hit {hit} of {whole} history tokens"
    # The test can fail: without the tier, LRU eviction has thrown the histories away.
    assert rounds_without[-1][0] < rounds[-1][0] / 2, rounds_without
    host = llm.scheduler.kv.host_tier.counters
    assert host.hits >= CONVERSATIONS * (ROUNDS - 2) and host.bytes_offloaded > 0
    assert host.bytes_loaded == host.tokens_loaded * llm.scheduler.kv.host_tier.host.bytes_per_token
    llm.scheduler.tracer.flush()
    report = check_file(str(trace))
    assert report.ok, format_report(report)
    assert '"kv_loaded"' in trace.read_text() and '"kv_offloaded"' in trace.read_text()


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_multiturn_concurrent_outputs_unchanged(model_path, policy):
    """Interleaved conversations (loads compete with neighbours for the pool, preemption happens)
    that share a system prompt: every request hits it, so write_through copies it early."""
    system = [(5 * j + 1) % 256 for j in range(4 * PS)]
    want, _, _ = converse(model_path, greedy, system=system, kv_cache_tokens=4096)
    got, rounds, llm = converse(
        model_path,
        greedy,
        system=system,
        kv_cache_tokens=POOL_TOKENS,
        max_running_requests=3,
        host_kv_cache_gb=0.01,
        host_kv_write_policy=policy,
    )
    assert got == want
    c = llm.scheduler.kv.host_tier.counters
    assert c.hits > 0 and (c.tokens_written_through > 0) == (policy == "write_through")


# -- the asynchronous path, on CPU ---------------------------------------------------------------
# "wait": a load in flight keeps its request out of every pass until it lands; "join": the load
# is expected to land at once, so the request joins the next pass, ordered after the copy.
@pytest.mark.parametrize("max_running", [1, 3])
@pytest.mark.parametrize("mode", ["wait", "join"])
def test_requests_wait_for_loads_in_flight(model_path, monkeypatch, max_running, mode):
    from deferred_load_tier import use_deferred_loads

    # join: loads stay in flight until a pass is ordered after them
    use_deferred_loads(monkeypatch, mode, polls_in_flight=10**6 if mode == "join" else None)
    want, _, _ = converse(model_path, seeded, kv_cache_tokens=4096)
    got, rounds, llm = converse(
        model_path,
        seeded,
        kv_cache_tokens=POOL_TOKENS,
        max_running_requests=max_running,
        host_kv_cache_gb=0.01,
    )
    tier = llm.scheduler.kv.host_tier
    assert type(tier).__name__ == "DeferredLoadTier"
    # wait: requests sat out passes; join: none did, their passes were ordered after the loads
    assert (tier.counters.load_waits > 0, tier.counters.loads_joined > 0) == (mode == "wait", mode == "join")
    assert got == want


def test_evicting_a_node_whose_load_is_in_flight_waits_for_it():
    """A request that hit the host tier ends before its load lands (aborted while waiting): a
    device eviction of those pages must let the copy finish first, or it lands on their next owner."""
    from deferred_load_tier import DeferredLoadTier

    pool = KVPool(2, 4 * PS, 2, 8, PS, torch.float32, torch.device("cpu"))
    cache = TieredRadixCache(
        PageAllocator(4, PS), DeferredLoadTier(pool, HostKVPool(pool, 8 * PS, PS, pin=False))
    )
    tokens = list(range(8))
    slots = [p * PS + i for p in cache.allocator.alloc(2) for i in range(PS)]
    cache.insert(tokens, slots, None)
    cache.evict(2)
    match = cache.match(tokens + [99])
    assert match.load is not None and not cache.tier.done(match.load)  # in flight
    cache.release(match.handle)  # its request went away
    assert cache.evict(4) == 2  # drops the device copy (the host keeps one)
    reused = [p * PS + i for p in cache.allocator.alloc(4) for i in range(PS)]
    fill(pool, reused, seed=3)  # the pages' next owner writes them
    want = rows(pool, reused)
    cache.tier._land(10**9)  # whatever was still in flight lands now
    assert all(torch.equal(a, b) for a, b in zip(rows(pool, reused), want))
    cache.allocator.free(cache.allocator.pages_of_slots(reused))
    cache.audit([])


def test_a_prompt_cached_over_pages_still_loading_waits_for_them(model_path, monkeypatch):
    """Request b computes its whole prompt (it wants prompt logprobs) while request a's load of
    the same prefix from the host tier is in flight. Caching b's prompt repoints b to the tree's
    pages, which are still loading, so b's later passes must wait for that copy: its output
    equals a run whose pool holds everything."""
    from deferred_load_tier import use_deferred_loads

    use_deferred_loads(monkeypatch, "wait", polls_in_flight=50)  # in flight through b's whole run
    prefix = [(5 * j + 1) % 256 for j in range(64)]
    fillers = [[(13 * c + j) % 256 for j in range(200)] for c in range(3)]  # push prefix to the host
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with_prompt_logprobs = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)

    def run(**options):
        llm = LLM(model_path, page_size=PS, log_level="warning", check_kv_invariants=True, **options)
        for prompt in [prefix, *fillers]:
            llm.generate_ids([prompt], plain, use_tqdm=False)
        a, b = prefix + [1, 2, 3], prefix + [4, 5, 6]
        outs = llm.generate_ids([a, b], [plain, with_prompt_logprobs], use_tqdm=False)
        return [o.token_ids for o in outs], llm

    want, _ = run(kv_cache_tokens=4096)
    got, llm = run(kv_cache_tokens=POOL_TOKENS, host_kv_cache_gb=0.01)
    assert llm.scheduler.kv.host_tier.counters.hits > 0
    assert got == want
