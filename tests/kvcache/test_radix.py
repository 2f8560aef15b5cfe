"""RadixCache: unit behaviour, and a stateful property test against a page-level model.

The model knows nothing about the tree's shape: it records, for every cached page-aligned
prefix, the page that backs it, and learns what eviction removed from the allocator's free
list (each tree page backs exactly one prefix). From that it predicts every match exactly.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minfer.kvcache.allocator import PageAllocator
from minfer.kvcache.radix import RadixCache


def _slots_of(pages: list[int], page_size: int) -> list[int]:
    return [p * page_size + i for p in pages for i in range(page_size)]


def _computed(cache: RadixCache, token_ids: list[int]) -> list[int]:
    """Slots for a request that found nothing cached: allocate, then give them to the tree."""
    ps = cache.page_size
    slots = _slots_of(cache.allocator.alloc(len(token_ids) // ps), ps)
    cache.insert(token_ids, slots, None)
    return slots


# -- unit tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 4])
def test_identical_sequence_hits_all_whole_pages(page_size):
    cache = RadixCache(PageAllocator(16, page_size))
    tokens = list(range(3 * page_size))
    slots = _computed(cache, tokens)
    m = cache.match(tokens + [99])  # a trailing partial page never matches
    assert m.slots == slots
    assert cache.counters.hit_tokens == len(tokens)
    assert cache.counters.queried_tokens == len(tokens) + 1
    assert cache.evictable_pages == 0 and cache.cached_pages == 3
    cache.release(m.handle)
    assert cache.evictable_pages == 3


def test_partial_page_is_not_matched():
    cache = RadixCache(PageAllocator(8, 4))
    slots = _computed(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.match([1, 2, 3]).slots == []
    m = cache.match([1, 2, 3, 4, 5, 6, 7])  # the second page differs nowhere but is incomplete
    assert m.slots == slots[:4]
    # Tokens diverging inside the second page: only the first page is shared.
    assert cache.match([1, 2, 3, 4, 5, 6, 0, 8]).slots == slots[:4]


def test_eviction_is_lru_and_page_exact():
    cache = RadixCache(PageAllocator(8, 2))
    a = _computed(cache, [1, 1, 1, 1])
    b = _computed(cache, [2, 2, 2, 2])
    cache.release(cache.match([1, 1, 1, 1]).handle)  # touch a: b is now least recently used
    assert cache.evict(1) == 1  # one page of b's tail, no more than asked
    assert cache.match([2, 2, 2, 2]).slots == b[:2]
    assert cache.match([1, 1, 1, 1]).slots == a
    assert cache.evictable_pages == 0  # both still held by the matches above
    assert cache.evict(4) == 0


def test_locked_path_survives_eviction_and_shared_parent_stays():
    cache = RadixCache(PageAllocator(8, 1))
    _computed(cache, [1, 2, 3])
    held = cache.match([1, 2, 4])  # splits after [1, 2] and locks that part
    assert held.slots and len(held.slots) == 2
    assert cache.evict(8) == 1  # only the [3] leaf can go
    assert cache.cached_pages == 2 and cache.evictable_pages == 0
    cache.release(held.handle)
    assert cache.evict(8) == 2 and cache.cached_pages == 0
    assert cache.allocator.num_free_pages == 8


def test_concurrent_duplicate_is_freed_and_borrowed_prefix_is_not():
    ps = 2
    alloc = PageAllocator(8, ps)
    cache = RadixCache(alloc)
    shared = _computed(cache, [1, 2])
    # Two requests borrow [1, 2] and both compute [3, 4] on their own pages.
    first, second = cache.match([1, 2, 3, 4]), cache.match([1, 2, 3, 4])
    own1, own2 = _slots_of(alloc.alloc(1), ps), _slots_of(alloc.alloc(1), ps)
    cache.insert([1, 2, 3, 4], first.slots + own1, first.handle)
    free_before = alloc.num_free_pages
    locked = cache.insert_and_lock([1, 2, 3, 4], second.slots + own2, second.handle)
    assert locked.slots == shared + own1  # the tree's copy, not the duplicate
    assert alloc.num_free_pages == free_before + 1 and own2[0] // ps in alloc._free
    assert cache.cached_pages == 2 and cache.evictable_pages == 0
    cache.release(locked.handle)
    assert cache.evictable_pages == 2


def test_insert_rejects_unaligned_runs():
    cache = RadixCache(PageAllocator(4, 4))
    with pytest.raises(ValueError, match="page_size=4"):
        cache.insert([1, 2, 3], [0, 1, 2], None)


# -- property test ---------------------------------------------------------------------------------
@dataclass
class _Request:
    token_ids: list[int]
    slots: list[int]  # one per token: the borrowed prefix, then the request's own pages
    borrowed: int  # tokens at the front whose pages the tree owns (locked by `handle`)
    own_pages: list[int]
    handle: object | None


NUM_PAGES = 12
# Requests share long prefixes (system prompts, earlier turns) far more often than random
# tokens would: cut one of a few base sequences, then add a short random tail.
BASES = [[0] * 16, [0, 1] * 8, [1, 2, 0, 0, 1, 2, 0, 0] * 2]
tokens_strategy = st.builds(
    lambda base, cut, tail: base[:cut] + tail,
    st.sampled_from(BASES),
    st.integers(0, 16),
    st.lists(st.integers(0, 2), max_size=5),
)


class RadixMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 4]))
    def setup(self, page_size):
        self.ps = page_size
        self.alloc = PageAllocator(NUM_PAGES, page_size)
        self.cache = RadixCache(self.alloc)
        self.requests: list[_Request] = []
        self.cached: dict[tuple[int, ...], int] = {}  # page-aligned prefix -> page backing its last page
        self.queried = self.hit = self.evicted = 0

    # The model's view of the tree.
    def expected_match(self, token_ids: list[int]) -> list[int]:
        pages = []
        for end in range(self.ps, len(token_ids) + 1, self.ps):
            page = self.cached.get(tuple(token_ids[:end]))
            if page is None:
                break
            pages.append(page)
        return _slots_of(pages, self.ps)

    def forget_freed_pages(self) -> None:
        free = set(self.alloc._free)
        self.cached = {k: p for k, p in self.cached.items() if p not in free}

    def locked_prefixes(self) -> set[tuple[int, ...]]:
        return {
            tuple(r.token_ids[:end]) for r in self.requests for end in range(self.ps, r.borrowed + 1, self.ps)
        }

    # Requests.
    @precondition(lambda self: len(self.requests) < 4)
    @rule(token_ids=tokens_strategy)
    def start(self, token_ids):
        m = self.cache.match(token_ids)
        self.queried += len(token_ids)
        self.hit += len(m.slots)
        assert m.slots == self.expected_match(token_ids)
        assert (m.handle is None) == (not m.slots)
        need = -(-(len(token_ids) - len(m.slots)) // self.ps)
        if need > self.alloc.num_free_pages:
            self.evict(need - self.alloc.num_free_pages)
        if need > self.alloc.num_free_pages:  # the pool is full of locked pages: the request waits
            self.cache.release(m.handle)
            return
        own = self.alloc.alloc(need)
        slots = (m.slots + _slots_of(own, self.ps))[: len(token_ids)]
        self.requests.append(_Request(token_ids, slots, len(m.slots), own, m.handle))

    def give_prefix_to_cache(self, req: _Request, lock: bool):
        """Insert the request's page-aligned prefix; returns the lock, if asked for one."""
        aligned = len(req.token_ids) // self.ps * self.ps
        prefix, slots = req.token_ids[:aligned], req.slots[:aligned]
        expected, duplicates = [], []
        for i, end in enumerate(range(self.ps, aligned + 1, self.ps)):
            mine = slots[i * self.ps] // self.ps
            cached = self.cached.setdefault(tuple(prefix[:end]), mine)
            if cached != mine:
                duplicates.append(mine)
            expected.append(cached)
        free_before = self.alloc.num_free_pages
        if lock:
            result = self.cache.insert_and_lock(prefix, slots, req.handle)
            assert result.slots == _slots_of(expected, self.ps)
        else:
            self.cache.insert(prefix, slots, req.handle)
            result = None
        assert self.alloc.num_free_pages == free_before + len(duplicates)
        req.own_pages = [p for p in req.own_pages if p not in set(expected) | set(duplicates)]
        return result

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish(self, data):
        req = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        self.give_prefix_to_cache(req, lock=False)
        self.alloc.free(req.own_pages)  # the partly filled tail page is not shareable

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def chunk_done(self, data):
        """Chunked prefill: the prefix so far goes to the tree while the request keeps running."""
        req = self.requests[data.draw(st.integers(0, len(self.requests) - 1))]
        locked = self.give_prefix_to_cache(req, lock=True)
        req.slots[: len(locked.slots)] = locked.slots
        req.borrowed, req.handle = len(locked.slots), locked.handle

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort(self, data):
        req = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        self.cache.release(req.handle)
        self.alloc.free(req.own_pages)

    @rule(num_pages=st.integers(0, NUM_PAGES))
    def evict(self, num_pages):
        evictable, free_before = self.cache.evictable_pages, self.alloc.num_free_pages
        freed = self.cache.evict(num_pages)
        assert freed == min(num_pages, evictable)  # exact: every unlocked page can go
        assert self.alloc.num_free_pages == free_before + freed
        self.evicted += freed
        self.forget_freed_pages()

    # Invariants.
    @invariant()
    def every_page_has_exactly_one_owner(self):
        if not hasattr(self, "cache"):
            return
        tree_pages = [s // self.ps for n in self.cache._nodes() for s in n.slots[:: self.ps]]
        request_pages = [p for r in self.requests for p in r.own_pages]
        owners = Counter(self.alloc._free + request_pages + tree_pages)
        assert owners == Counter(range(NUM_PAGES))
        assert self.cache.cached_pages == len(tree_pages)
        assert sorted(tree_pages) == sorted(self.cached.values())

    @invariant()
    def locked_prefixes_stay_cached(self):
        if not hasattr(self, "cache"):
            return
        for r in self.requests:
            assert self.expected_match(r.token_ids[: r.borrowed]) == r.slots[: r.borrowed]
        assert self.locked_prefixes() <= self.cached.keys()

    @invariant()
    def evictable_pages_is_exact(self):
        if not hasattr(self, "cache"):
            return
        walked = sum(len(n.slots) // self.ps for n in self.cache._nodes() if n.lock_count == 0)
        assert self.cache.evictable_pages == walked
        assert walked == len(self.cached) - len(self.locked_prefixes())

    @invariant()
    def counters_add_up(self):
        if not hasattr(self, "cache"):
            return
        c = self.cache.counters
        assert (c.queried_tokens, c.hit_tokens, c.evicted_pages) == (self.queried, self.hit, self.evicted)


RadixMachine.TestCase.settings = settings(max_examples=500, stateful_step_count=50, deadline=None)
TestRadixMachine = RadixMachine.TestCase
