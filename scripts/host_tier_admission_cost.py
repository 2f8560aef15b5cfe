"""CPU time of a host-tier prefix match (the admission of a returning conversation) on a tree
the size of the Llama-8B multi-turn run of scripts/gpu_hostkv_check.py: 10 conversations x 5
rounds (first turn 1,024 tokens, turns 256, answers 64), page size 16, a device pool a quarter
of the working set (5,920 tokens), every history kept on the host. The pool's rows are tiny
(one layer, one head of 8 floats), so copies cost nothing and what is timed is the tree's
bookkeeping: the match, its evictions (write-backs) and the load's issue.

    PYTHONPATH=$PWD python3 scripts/host_tier_admission_cost.py

Prints the mean and max milliseconds per match of the last round.
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


def main() -> None:
    pool = KVPool(1, POOL, 1, 8, PS, torch.float32, torch.device("cpu"))
    cache = TieredRadixCache(
        PageAllocator(POOL // PS, PS), HostTier(pool, HostKVPool(pool, HOST, PS, pin=False))
    )
    rng = random.Random(0)
    histories = [[rng.randrange(50000) for _ in range(FIRST)] for _ in range(CONVERSATIONS)]
    for r in range(ROUNDS):
        times = []
        for c, tokens in enumerate(histories):
            start = time.perf_counter()
            match = cache.match(tokens)
            times.append(time.perf_counter() - start)
            # the request's own new pages: its turn and answer, page-aligned
            total = len(tokens) + ANSWER
            new = total // PS * PS - len(match.slots)
            short = new // PS - cache.allocator.num_free_pages
            if short > 0:
                cache.evict(short)
            slots = match.slots + [p * PS + i for p in cache.allocator.alloc(new // PS) for i in range(PS)]
            sequence = tokens + [rng.randrange(50000) for _ in range(ANSWER)]
            cache.insert(sequence[: len(slots)], slots, match.handle)
            histories[c] = sequence + [rng.randrange(50000) for _ in range(TURN)]
        print(
            f"round {r + 1}: match {1e3 * sum(times) / len(times):.2f} ms mean, {1e3 * max(times):.2f} max "
            f"({sum(1 for _ in cache._nodes())} nodes)"
        )


if __name__ == "__main__":
    main()
