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
    ps = cache.page_size
    node, matched, pages = cache._root, 0, 0
    while (child := node.children.get(tuple(token_ids[matched : matched + ps]))) is not None:
        common = ps
        limit = min(len(child.token_ids), len(token_ids) - matched)
        while common + ps <= limit and (
            child.token_ids[common : common + ps] == token_ids[matched + common : matched + common + ps]
        ):
            common += ps
        if not child.slots or child.lock_count == 0:
            pages += common // ps
        matched += common
        if common < len(child.token_ids):
            break
        node = child
    return matched, pages
