"""The prefix-cache interface, and the naive cache that shares nothing.

A prefix cache owns the pages of finished (or partly prefilled) sequences so that a later
request with the same leading tokens reuses their K/V instead of recomputing it. Keys are
token ids, values are slots, both cut at page boundaries. Pages a running request borrowed
are locked and never evicted; unlocked ones go back to the allocator under pressure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from minfer.kvcache.allocator import PageAllocator


class KVInvariantError(RuntimeError):
    """The KV bookkeeping disagrees with itself (a page owned twice or by no one, a wrong lock
    count): outputs computed from here on could be silently wrong, so this is never caught."""


@dataclass
class PrefixMatch:
    """`slots` hold K/V of the first `len(slots)` tokens; `handle` locks them while in use.
    `load`: a host-tier copy into some of those slots still in flight (CUDA), else None."""

    slots: list[int]
    handle: object | None
    load: object | None = None


@dataclass
class CacheCounters:
    """Running totals the metrics exporter reads."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    evicted_pages: int = 0


class PrefixCache(Protocol):
    counters: CacheCounters

    def match(self, token_ids: list[int]) -> PrefixMatch:
        """Longest cached page-aligned prefix of `token_ids`, locked for the caller."""

    def release(self, handle: object | None) -> None:
        """Unlock what `match` or `insert_and_lock` locked."""

    def prefix_length(self, token_ids: list[int]) -> int:
        """Length `match` would return, with no side effect."""

    def insert(self, token_ids: list[int], slots: list[int], handle: object | None) -> None:
        """Give the cache the page-aligned prefix (`len(token_ids) % page_size == 0`) and its slots.

        Ownership of the pages moves to the cache; pages it already holds for the same tokens
        are freed. `handle` is the caller's lock from `match`, released here.
        """

    def insert_and_lock(self, token_ids: list[int], slots: list[int], handle: object | None) -> PrefixMatch:
        """Like insert, but keep the inserted prefix locked for a request that goes on running
        (chunked prefill); returns the new lock and the slots now backing the prefix."""

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` unlocked pages, least recently used first; returns how many."""

    def audit(self, handles: list[object]) -> list[int]:
        """Check the cache's own counts against the locks `handles` hold (one per request that
        holds one); returns every page the cache owns. Raises KVInvariantError."""

    def handle_slots(self, handle: object | None) -> list[int]:
        """The slots of the prefix a handle locks, in position order."""

    @property
    def evictable_pages(self) -> int: ...

    @property
    def cached_pages(self) -> int: ...


class NaiveCache:
    """Shares nothing: every page goes back to the allocator when its request ends."""

    def __init__(self, allocator: PageAllocator):
        self.allocator = allocator
        self.counters = CacheCounters()

    def match(self, token_ids: list[int]) -> PrefixMatch:
        self.counters.queried_tokens += len(token_ids)
        return PrefixMatch([], None)

    def release(self, handle: object | None) -> None:
        pass

    def prefix_length(self, token_ids: list[int]) -> int:
        return 0

    def insert(self, token_ids: list[int], slots: list[int], handle: object | None) -> None:
        self.allocator.free(self.allocator.pages_of_slots(slots))

    def insert_and_lock(self, token_ids: list[int], slots: list[int], handle: object | None) -> PrefixMatch:
        return PrefixMatch(list(slots), None)  # the request keeps owning its pages

    def evict(self, num_pages: int) -> int:
        return 0

    def audit(self, handles: list[object]) -> list[int]:
        if any(h is not None for h in handles):
            raise KVInvariantError("the naive cache hands out no locks, but a request holds one")
        return []

    def handle_slots(self, handle: object | None) -> list[int]:
        return []

    @property
    def evictable_pages(self) -> int:
        return 0

    @property
    def cached_pages(self) -> int:
        return 0
