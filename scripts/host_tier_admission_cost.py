"""CPU time of a host-tier prefix match (the admission of a returning conversation) on a tree
the size of the Llama-8B multi-turn run of scripts/gpu_hostkv_check.py: 10 conversations x 5
rounds (first turn 1,024 tokens, turns 256, answers 64), page size 16, a device pool a quarter
of the working set (5,920 tokens), every history kept on the host. The pool's rows are tiny
(one layer, one head of 8 floats), so copies cost nothing and what is timed is the tree's
bookkeeping: the match, its evictions (write-backs) and the load's issue.

    PYTHONPATH=$PWD python3 scripts/host_tier_admission_cost.py

Prints per round the mean and max milliseconds per match, and the offload transfers (calls of
HostTier.offload, each one gather kernel per layer and K/V per staging chunk on CUDA) per
admission: the match and the eviction that makes room for the request's own pages.
"""

from __future__ import annotations

import random
import time

import torch

from minfer.kvcache.allocator import PageAllocator
from minfer.kvcache.host_pool import HostKVPool
from minfer.kvcache.host_tier import HostTier
from minfer.kvcache.pool import KVPool
from minfer.kvcache.tiered_radix import TieredRadixCache

PS, POOL, HOST = 16, 5920, 32768
CONVERSATIONS, ROUNDS, FIRST, TURN, ANSWER = 10, 5, 1024, 256, 64


def take(cache: TieredRadixCache, pages: int) -> int:
    """Make room for `pages` device pages (evicting), as KVManager does before an allocation."""
    short = pages - cache.allocator.num_free_pages
    if short > 0:
        cache.evict(short)
    return pages


def main() -> None:
    torch.set_num_threads(1)  # the copies are tiny: a thread pool only adds wake-up noise
    pool = KVPool(1, POOL, 1, 8, PS, torch.float32, torch.device("cpu"))
    cache = TieredRadixCache(
        PageAllocator(POOL // PS, PS), HostTier(pool, HostKVPool(pool, HOST, PS, pin=False))
    )
    rng = random.Random(0)
    histories = [[rng.randrange(50000) for _ in range(FIRST)] for _ in range(CONVERSATIONS)]
    for r in range(ROUNDS):
        times, in_match = [], 0
        transfers0 = cache.tier.counters.offload_copies
        for c, tokens in enumerate(histories):
            start = time.perf_counter()
            before = cache.tier.counters.offload_copies
            match = cache.match(tokens)
            times.append(time.perf_counter() - start)
            in_match += cache.tier.counters.offload_copies - before
            # The request's own pages as the scheduler takes them: the prompt's at once (prefill),
            # then one page at a time while it decodes, each making room with a one-page eviction
            # (which is what splits the tree into page-sized nodes on a real run).
            pages = cache.allocator.alloc(take(cache, len(tokens) // PS - len(match.slots) // PS))
            for _ in range((len(tokens) + ANSWER) // PS - len(tokens) // PS):
                pages += cache.allocator.alloc(take(cache, 1))
            slots = match.slots + [p * PS + i for p in pages for i in range(PS)]
            sequence = tokens + [rng.randrange(50000) for _ in range(ANSWER)]
            cache.insert(sequence[: len(slots)], slots, match.handle)
            histories[c] = sequence + [rng.randrange(50000) for _ in range(TURN)]
        print(
            f"round {r + 1}: match {1e3 * sum(times) / len(times):.2f} ms mean, {1e3 * max(times):.2f} max "
            f"({sum(1 for _ in cache._nodes())} nodes); "
            f"offload transfers per admission {in_match / len(histories):.1f} in the match, "
            f"{(cache.tier.counters.offload_copies - transfers0 - in_match) / len(histories):.1f} while decoding"
        )


if __name__ == "__main__":
    main()
