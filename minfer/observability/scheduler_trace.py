"""The scheduler's trace events, written in one place.

The scheduler calls one method per moment of a request's life; `SchedulerTrace` turns each into
the event lines declared in observability/events.py, `NullSchedulerTrace` (tracing off) does
nothing. The scheduler never builds an event itself, so an untraced step pays one no-op call
per moment.
"""

from __future__ import annotations

import hashlib

from minfer.core import Batch, Req
from minfer.observability import events as schema
from minfer.observability.trace import RequestTracer, slot_ranges


class NullSchedulerTrace:
    """Tracing off: every moment is a no-op."""

    enabled = False

    def pool(self, num_slots: int, page_size: int) -> None: ...
    def queued(self, req: Req) -> None: ...
    def admitted(self, req: Req, resumed: bool) -> None: ...
    def scheduled(self, batch: Batch) -> None: ...
    def advanced(self, batch: Batch, moved: dict[int, list]) -> None: ...
    def forward_done(self, batch: Batch) -> None: ...
    def token_sampled(self, req: Req, token: int) -> None: ...
    def preempted(self, req: Req) -> None: ...
    def released(self, req: Req, slots: list[int], page_size: int) -> None: ...
    def ended(self, req: Req) -> None: ...
    def kv_offloaded(self, device_slots, host_slots, prefix_tokens, node_len) -> None: ...
    def kv_loaded(self, device_slots, host_slots, prefix_tokens, node_len) -> None: ...


def page_digests(prefix_tokens: list[int], node_len: int, page_size: int) -> list[str]:
    """For each page of the node ending `prefix_tokens` (its last `node_len` tokens), a digest of
    every token id from position 0 through that page."""
    start = len(prefix_tokens) - node_len
    # Page by page from position 0, so a digest does not depend on where the tree's edges split.
    h = hashlib.blake2b(digest_size=8)
    out = []
    for i in range(0, len(prefix_tokens), page_size):
        h.update(str(prefix_tokens[i : i + page_size]).encode())
        if i >= start:
            out.append(h.copy().hexdigest())
    return out


class SchedulerTrace(NullSchedulerTrace):
    """Every moment as event lines on a RequestTracer (uid -1 is the run itself)."""

    enabled = True

    def __init__(self, tracer: RequestTracer):
        self.tracer = tracer
        self.page_size = 1  # set by `pool`

    def kv_offloaded(self, device_slots, host_slots, prefix_tokens, node_len) -> None:
        self._transfer(schema.KV_OFFLOADED, device_slots, host_slots, prefix_tokens, node_len)

    def kv_loaded(self, device_slots, host_slots, prefix_tokens, node_len) -> None:
        self._transfer(schema.KV_LOADED, device_slots, host_slots, prefix_tokens, node_len)

    def _transfer(self, spec, device_slots, host_slots, prefix_tokens, node_len) -> None:
        self.tracer.emit(
            spec,
            -1,
            device=slot_ranges(device_slots),
            host=slot_ranges(host_slots),
            digests=page_digests(prefix_tokens, node_len, self.page_size),
        )

    def pool(self, num_slots: int, page_size: int) -> None:
        self.page_size = page_size
        self.tracer.emit(schema.KV_POOL, -1, num_slots=num_slots, page_size=page_size)

    def queued(self, req: Req) -> None:
        self.tracer.emit(schema.QUEUED, req.uid, prompt_len=req.prompt_len, max_tokens=req.params.max_tokens)

    def admitted(self, req: Req, resumed: bool) -> None:
        if resumed:
            self.tracer.emit(schema.RESUMED, req.uid, **req.state())
        self.tracer.emit(
            schema.PREFIX_MATCHED, req.uid, hit_tokens=req.cached_len, queried_tokens=req.device_len - 1
        )

    def scheduled(self, batch: Batch) -> None:
        start = 0
        for req, n in zip(batch.reqs, batch.extend_lens):
            self.tracer.emit(
                schema.BATCH_SCHEDULED, req.uid, phase=batch.phase.value, batch_size=batch.size, chunk=n
            )
            self.tracer.emit(
                schema.KV_SLOTS_ALLOCATED,
                req.uid,
                **req.state(),
                num_slots=n,
                out_loc=slot_ranges(batch.out_loc[start : start + n]),
                table_idx=req.table_idx,
            )
            start += n

    def advanced(self, batch: Batch, moved: dict[int, list]) -> None:
        """After the launch moved each request's lengths; `moved[uid]`: prompt_cached repointings."""
        for req, n, sampled in zip(batch.reqs, batch.extend_lens, batch.sample_mask):
            after = req.state()
            before = {"cached_len": after["cached_len"] - n, "device_len": after["device_len"] - sampled}
            before["extend_len"] = before["device_len"] - before["cached_len"]
            self.tracer.emit(schema.REQUEST_STATE_UPDATED, req.uid, before=before, after=after)
            if req.uid in moved:
                self.tracer.emit(
                    schema.PROMPT_CACHED,
                    req.uid,
                    cached_len=req.cached_len,
                    repointed=[list(m) for m in moved[req.uid]],
                )

    def forward_done(self, batch: Batch) -> None:
        for req in batch.reqs:
            if not req.finished:
                self.tracer.emit(schema.FORWARD_DONE, req.uid, phase=batch.phase.value)

    def token_sampled(self, req: Req, token: int) -> None:
        self.tracer.emit(schema.TOKEN_SAMPLED, req.uid, token_id=token, output_len=req.output_len + 1)

    def preempted(self, req: Req) -> None:
        self.tracer.emit(schema.PREEMPTED, req.uid, **req.state())

    def released(self, req: Req, slots: list[int], page_size: int) -> None:
        kept = (req.cached_len // page_size) * page_size
        self.tracer.emit(
            schema.KV_RELEASED,
            req.uid,
            cached=slot_ranges(slots[:kept]),
            freed=slot_ranges(slots[kept:]),
            cached_len=req.cached_len,
        )

    def ended(self, req: Req) -> None:
        event = schema.ABORTED if req.finish_reason == "abort" else schema.FINISHED
        self.tracer.emit(
            event,
            req.uid,
            reason=req.finish_reason,
            prompt_len=req.prompt_len,
            output_len=req.output_len,
            **req.state(),
        )


def scheduler_trace(tracer: RequestTracer) -> NullSchedulerTrace:
    return SchedulerTrace(tracer) if tracer.enabled else NullSchedulerTrace()
