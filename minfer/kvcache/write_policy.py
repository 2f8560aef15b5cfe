"""When a device node of the tiered radix cache (tiered_radix.py) gets its host copy.

  write_back     on eviction from the device pool: only what is evicted is copied, but the
                 eviction, which runs while a request waits for room, pays for the gather.
  write_through  also on a node's second hit: a node the workload comes back to is likely to
                 be wanted again after it is evicted, so its copy is made early, while it
                 keeps its device pages, and its later eviction only frees them.

A write-through copy never blocks and never costs the host tier a node it values more: it takes
free host pages, or host pages that LRU host eviction frees from nodes hit at most as often
(and with no load in flight, whose wait would block), or it is not made at all (the eviction
will write the node back as under write_back, if there is room then).
"""

from __future__ import annotations

import functools


def _may_drop(node, hits: int) -> bool:
    """A host copy a write-through may take the place of: hit no more often, no load in flight."""
    return node.hits <= hits and node.loading is None


WRITE_POLICIES = ("write_back", "write_through")
WRITE_THROUGH_HITS = 2  # "hit more than once" (issue 15)


def write_through(cache, path: list) -> None:
    """Copy the device-only nodes of a matched, locked `path` hit WRITE_THROUGH_HITS times or
    more to the host tier, in one offload; they keep their device pages. `cache` is a
    TieredRadixCache (not imported: it imports this module)."""
    ps = cache.page_size
    device_slots: list[int] = []
    host_slots: list[int] = []
    for node in path:
        if not node.slots or node.host_slots or node.hits < WRITE_THROUGH_HITS:
            continue
        pages = len(node.slots) // ps
        short = pages - cache.host_allocator.num_free_pages
        if short > 0:
            cache.evict_host(short, may_drop=functools.partial(_may_drop, hits=node.hits))
        if cache.host_allocator.num_free_pages < pages:
            continue
        node.host_slots = [p * ps + i for p in cache.host_allocator.alloc(pages) for i in range(ps)]
        cache.host_pages += pages
        cache.written_through.update(s // ps for s in node.host_slots[::ps])
        device_slots += node.slots
        host_slots += node.host_slots
    if device_slots:
        cache.tier.offload(device_slots, host_slots)
        cache.tier.counters.tokens_written_through += len(device_slots)
