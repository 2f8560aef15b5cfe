"""What a tiered prefix match would cost, found without making it.

`TieredRadixCache.match` acts as it matches: it evicts device pages (writing them back) to make
room for the host-only part of the path and queues the load. An admission that then finds the
request does not fit undoes the lock but not that work, and a request at the head of the queue
retries every step: on a multi-turn run most admission attempts were such retries (85 of 109 on
tests/kvcache/test_host_tier.py's conversations with two running). This walk prices the match
without side effects, so the scheduler can see the request cannot fit before paying for it.
"""

from __future__ import annotations


def match_cost(cache, token_ids: list[int]) -> tuple[int, int]:
    """(tokens `cache.match(token_ids)` would return if the device pool takes the whole path,
    pages it would take out of `cache`'s free plus evictable pages): every matched page that is
    on the host only (it takes a free page) or on the device unlocked (it becomes locked).
    `cache` is a TieredRadixCache; nothing is split, locked, loaded or marked used."""
    matched = pages = 0
    for node, common in cache._edges(token_ids):
        matched += common
        if not node.slots or node.lock_count == 0:
            pages += common // cache.page_size
    return matched, pages
