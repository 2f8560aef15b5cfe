"""Decode batching and preemption: every running request gets one more token per step; when
the pool cannot hold one more token each, requests are sent back to the queue."""

from __future__ import annotations

import logging

from minfer.core import Batch, Phase, Req
from minfer.kvcache.manager import KVManager
from minfer.observability.scheduler_trace import NullSchedulerTrace
from minfer.scheduler.queues import RequestQueues

log = logging.getLogger(__name__)

# From this many requests a decode batch runs longest context first. The decode attention grid
# takes the requests in batch order, one program per (kv head, request) once the batch fills the
# GPU, so long requests at the end leave a last wave in which most SMs idle. Kernel alone, H100
# (scripts/gpu_decode_layout.py --order, contexts 100-2048): 128 running 204 -> 188 us (bf16),
# 125 -> 111 us (fp8). `bench offline qwen3-0.6b` on an H200: 25,393 -> 26,341 tok/s (bf16),
# 30,598 -> 32,261 (fp8). From 8 instead of 32: the 16-31 band 2.23 -> 2.09 ms per step (fp8),
# 8-15 unchanged, so 16 (docs/BENCHMARKS.md, twenty-fourth session).
LONGEST_FIRST_FROM = 16


class DecodePlanner:
    def __init__(self, queues: RequestQueues, kv: KVManager, trace: NullSchedulerTrace, counters):
        self.queues = queues
        self.kv = kv
        self.trace = trace
        self.counters = counters

    def plan(self) -> Batch | None:
        # A request whose in-flight step (overlap mode) reaches max_tokens needs no more steps.
        # A grammar needs its previous token accepted before it can mask the next (grammar.py).
        reqs = [
            r
            for r in self.queues.running
            if r.device_len - r.prompt_len < r.params.max_tokens
            and (r.grammar is None or len(r.token_ids) == r.device_len)
        ]
        if not reqs:
            return None
        # Each request needs a slot for its newest token; free some by preemption, half-
        # prefilled requests first, then the newest running ones. The oldest always fits alone
        # (add_request checks prompt + max_tokens against the pool).
        while not self.kv.reserve_pages(sum(self.kv.pages_needed(r, 1) for r in reqs)):
            prefilling = self.queues.prefilling
            victim = prefilling[-1] if prefilling else reqs[-1]
            self.preempt(victim)
            if victim in reqs:
                reqs.remove(victim)
            if not reqs:
                return None
        if len(reqs) >= LONGEST_FIRST_FROM:
            # a new list: the running queue keeps admission order, which preemption goes by
            reqs.sort(key=lambda r: r.device_len, reverse=True)
        batch = Batch(Phase.DECODE, reqs, [1] * len(reqs))
        batch.sample_mask = [True] * len(reqs)
        return batch

    def preempt(self, req: Req) -> None:
        """Send a request back to the front of the queue, keeping its tokens; its KV goes to the
        prefix cache (so resuming may reuse it) or back to the pool."""
        q = self.queues
        (q.prefilling if req in q.prefilling else q.running).remove(req)
        self.trace.preempted(req)
        self.trace.released(req, self.kv.release(req), self.kv.page_size)
        req.cached_len = 0
        req.preempted = True
        q.waiting.appendleft(req)
        self.counters.preemptions += 1
        log.debug("preempted request %d at %d tokens", req.uid, req.device_len)
