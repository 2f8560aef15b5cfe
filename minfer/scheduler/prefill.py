"""Prefill admission: which waiting requests start now, and how many prompt tokens each computes.

A prefill batch spends a token budget (`chunked_prefill_size`): requests already holding KV
(chunked prefill in progress) finish their prompts first, then waiting requests are admitted
in queue order while the budget, the free pages, the running-request cap and the page-table
rows allow. Each admitted request keeps one page in reserve for its first decode step.
"""

from __future__ import annotations

from collections import deque

from minfer.config import EngineConfig
from minfer.core import Batch, Phase, Req
from minfer.kvcache.manager import KVManager
from minfer.observability.scheduler_trace import NullSchedulerTrace
from minfer.scheduler.queues import RequestQueues

# Prompts whose first this-many tokens agree are assumed to share a prefix worth waiting for.
SHARED_HEAD_TOKENS = 32


class PrefillPlanner:
    def __init__(
        self,
        queues: RequestQueues,
        kv: KVManager,
        config: EngineConfig,
        max_running: int,
        reserve_pages: int,
        trace: NullSchedulerTrace,
    ):
        self.queues = queues
        self.kv = kv
        self.config = config
        self.max_running = max_running
        self.reserve_pages = reserve_pages  # per request, for its next decode step
        self.trace = trace

    def plan(self) -> Batch | None:
        q = self.queues
        self.order_waiting()
        budget = self.config.chunked_prefill_size
        reqs, lens = [], []
        free_pages = self.kv.available_pages - self.reserve_pages * len(q.running)
        for req in q.prefilling:  # requests already holding KV finish their prompts first
            if budget <= 0:
                break
            if not self.kv.load_ready(req):  # its prefix is still coming from the host tier
                continue
            n = min(req.extend_len, budget)
            need = self.kv.pages_needed(req, n)
            if need > free_pages:
                break
            self.kv.claim_load(req)
            free_pages -= need
            reqs.append(req)
            lens.append(n)
            budget -= n
        # Requests admitted in this batch (or still prefilling in chunks) are not in the prefix
        # cache yet; a waiting request that starts like one of them waits and then reuses its
        # prefix instead of recomputing it.
        admitted_heads = {
            head
            for req in q.prefilling
            if (head := self.shareable_head(req))
            and self.kv.prefix_cache.prefix_length(list(head)) < len(head)
        }
        deferred: list[Req] = []
        while q.waiting and budget > 0:
            if (
                len(q.running) + len(q.prefilling) >= self.max_running
                or self.kv.page_table.num_free_rows == 0
            ):
                break
            req = q.waiting[0]
            head = self.shareable_head(req)
            if head and head in admitted_heads and not req.output_len:
                deferred.append(q.waiting.popleft())
                continue
            admitted = self.kv.try_admit(req, budget, free_pages, self.reserve_pages)
            if admitted is None:
                break
            n, cost = admitted
            q.waiting.popleft()
            if head and req.cached_len < len(head):
                admitted_heads.add(head)
            self.trace.admitted(req, resumed=req.preempted)
            req.preempted = False
            free_pages -= cost
            q.prefilling.append(req)
            if not self.kv.load_ready(req):  # joins a later batch, once its load (nearly) landed
                continue
            self.kv.claim_load(req)
            reqs.append(req)
            lens.append(n)
            budget -= n
        q.waiting.extendleft(reversed(deferred))
        if not reqs:
            return None
        batch = Batch(Phase.PREFILL, reqs, lens)
        batch.sample_mask = [r.cached_len + n == r.device_len for r, n in zip(reqs, lens)]
        return batch

    def order_waiting(self) -> None:
        """Longest-prefix-match policy: requests whose prompt the cache already holds most of go
        first, so shared prefixes are reused before they are evicted. FCFS keeps arrival order.
        Preempted requests stay at the front either way (they were admitted before)."""
        q = self.queues
        if self.config.schedule_policy != "lpm" or len(q.waiting) < 2:
            return
        cache = self.kv.prefix_cache
        resumed = [r for r in q.waiting if r.preempted]
        fresh = sorted(
            (r for r in q.waiting if not r.preempted),
            key=lambda r: -cache.prefix_length(r.token_ids[: r.device_len - 1]),
        )
        q.waiting = deque(resumed + fresh)

    def shareable_head(self, req: Req) -> tuple[int, ...] | None:
        """The first SHARED_HEAD_TOKENS tokens, or a shorter prompt's whole known part (so the n
        copies of one short request share it too); None when too short to be worth a wait."""
        head = tuple(req.token_ids[: min(SHARED_HEAD_TOKENS, req.device_len - 1)])
        if len(head) == SHARED_HEAD_TOKENS or (
            len(head) == req.device_len - 1 and len(head) >= max(1, self.config.page_size)
        ):
            return head
        return None
