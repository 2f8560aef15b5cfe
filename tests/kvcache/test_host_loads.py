"""The host tier's loads in flight (kvcache/host_loads.py): landing in order, the wait estimate a
pass uses to take a request whose load has not landed, and the prompt-caching path that must
wait for a load too. CUDA events are stood in for by objects with the same three methods."""

from __future__ import annotations

import torch

from minfer.kvcache.allocator import PageAllocator
from minfer.kvcache.host_loads import DEFAULT_LOAD_BANDWIDTH, LoadQueue
from minfer.kvcache.host_pool import HostKVPool
from minfer.kvcache.host_tier import HostTierCounters
from minfer.kvcache.pool import KVPool
from minfer.kvcache.tiered_radix import TieredRadixCache

MB = 1 << 20


class Event:
    """A CUDA event's query / elapsed_time, completed by the test."""

    def __init__(self, ms: float = 0.0):
        self.ms, self.complete = ms, False

    def query(self) -> bool:
        return self.complete

    def elapsed_time(self, end: Event) -> float:
        return end.ms - self.ms


def issue(queue: LoadQueue, num_bytes: int, ms: float, after: Event | None = None):
    return queue.issue(Event(0.0), Event(ms), num_bytes, after)


def test_loads_land_in_order_and_are_counted_once():
    counters = HostTierCounters()
    queue = LoadQueue(counters)
    first, second = issue(queue, 100 * MB, 2.0), issue(queue, 50 * MB, 3.0)
    assert not queue.has_landed(first) and counters.loads == 0
    first.end.complete = True
    assert queue.has_landed(first) and not queue.has_landed(second)
    assert (counters.loads, counters.load_bytes_timed) == (1, 100 * MB)
    second.end.complete = True
    queue.poll()
    queue.poll()
    assert (counters.loads, counters.load_bytes_timed, len(queue.in_flight)) == (2, 150 * MB, 0)
    assert abs(counters.load_seconds_sum - 0.005) < 1e-12


def test_expected_wait_counts_the_loads_queued_before():
    counters = HostTierCounters()
    queue = LoadQueue(counters)
    first, second = issue(queue, 100 * MB, 2.0), issue(queue, 50 * MB, 3.0)
    # Nothing timed yet: the cautious default bandwidth, over this load and the one before it.
    assert queue.expected_wait(second) == 150 * MB / DEFAULT_LOAD_BANDWIDTH
    first.end.complete = True  # lands in 2 ms: 100 MB at 52.4 GB/s from now on
    assert queue.expected_wait(first) == 0.0
    assert abs(queue.expected_wait(second) - 50 * MB / (100 * MB / 0.002)) < 1e-12
    # A load still waiting for an offload's copy-out is not estimated: it never joins a pass.
    offload = Event()
    third = issue(queue, MB, 1.0, after=offload)
    assert queue.expected_wait(third) == float("inf")
    offload.complete = True
    assert queue.expected_wait(third) < 0.01


def test_a_joined_load_is_waited_for_once(monkeypatch):
    waits = []
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda device: type("S", (), {"wait_event": waits.append})()
    )
    counters = HostTierCounters()
    queue = LoadQueue(counters)
    load = issue(queue, 100 * MB, 2.0)
    queue.order_compute_after(load, torch.device("cpu"))
    queue.order_compute_after(load, torch.device("cpu"))  # a second request sharing it
    assert waits == [load.end] and counters.loads_joined == 1
    assert queue.expected_wait(load) == 0.0  # the compute stream already waits for it


def test_caching_a_prompt_over_nodes_still_loading_returns_their_load():
    """A request that computed its own prompt is repointed to the tree's pages where they
    duplicate its own; if those are still loading, its later passes must wait for the copy."""
    from deferred_load_tier import DeferredLoadTier

    ps = 4
    pool = KVPool(2, 4 * ps, 2, 8, ps, torch.float32, torch.device("cpu"))
    cache = TieredRadixCache(
        PageAllocator(4, ps), DeferredLoadTier(pool, HostKVPool(pool, 8 * ps, ps, False))
    )
    tokens = list(range(8))
    slots = [p * ps + i for p in cache.allocator.alloc(2) for i in range(ps)]
    cache.insert(tokens, slots, None)
    cache.evict(2)  # both pages to the host
    hit = cache.match(tokens + [99])  # loads them back: in flight
    assert hit.load is not None and not cache.tier.done(hit.load)
    own = [p * ps + i for p in cache.allocator.alloc(2) for i in range(ps)]
    caching = cache.insert_and_lock(tokens, own, None)  # the tree keeps its (loading) pages
    assert caching.slots == hit.slots != own
    assert caching.load is not None and caching.load.seq == hit.load.seq
    cache.tier.wait(caching.load)
    cache.release(hit.handle)
    cache.release(caching.handle)
    cache.audit([])
