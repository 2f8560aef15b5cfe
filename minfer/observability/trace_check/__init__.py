"""`minfer trace check`: replay a request trace and verify every request against DESIGN.md.

Every line must be an event of the schema (observability/events.py) with its declared fields.

Per request (docs/TRACE.md lists the rules with the events they read):
  - events come in a legal order (queued first, one batch_scheduled -> kv_slots_allocated ->
    request_state_updated triple per pass, a token only after a pass that samples, nothing
    after the end, exactly one end);
  - a prefill allocates exactly the positions the prefix cache did not hold, chunk by chunk,
    from the hit up to the request's known tokens (again after each resume);
  - a decode pass allocates one slot and advances cached_len and device_len by one each;
  - every state a later event reports is the state the earlier events imply;
  - the final state of a finished request is cached_len = prompt_len + output_len - 1;
  - every allocated slot is released exactly once, cached or freed, by its request.
Across requests: no slot is allocated while a live request holds it, a prefix hit only
borrows slots the cache held, and a borrowed (locked) slot is not reallocated while borrowed.

Events of one scheduler process are checked in file order (one writer thread writes them in
the order they were emitted); a file holding several scheduler processes (two runs appended
to one file) is checked one process at a time.

The rules are split by concern: stream.py (the order common to every event), lifecycle.py
(admission and end), passes.py (one pass), slots.py (KV slots); request.py holds the state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minfer.observability import events as schema
from minfer.observability.trace_check.host_tier import EVENTS as HOST_TIER_EVENTS
from minfer.observability.trace_check.host_tier import HostTierReplay
from minfer.observability.trace_check.request import RequestCheck, fmt_state
from minfer.observability.trace_check.stream import SchedulerStream

__all__ = ["RequestCheck", "TraceReport", "check_events", "check_file", "format_report"]

FRONTEND_EVENTS = frozenset(s.name for s in schema.EVENTS if s.process != schema.SCHEDULER)
REPLAYED_EVENTS = frozenset(s.name for s in schema.EVENTS if s.process == schema.SCHEDULER and s.replayed)


@dataclass
class TraceReport:
    requests: list[RequestCheck]
    errors: list[str]  # not tied to one request (batch composition, unknown events, front end)
    num_events: int = 0
    # Every slot's life, in event order: (event number, kind, slot, uid); kinds are alloc,
    # share, borrow, unborrow, dup_free, release_cached, release_freed (see slots.replay_slots).
    slot_events: list[tuple[int, str, int, int]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors and all(r.ok for r in self.requests)

    @property
    def failed(self) -> list[RequestCheck]:
        return [r for r in self.requests if not r.ok]


def check_events(events: list[dict]) -> TraceReport:
    """Replay a trace (events in file order) and return every violation found."""
    streams: dict[int, SchedulerStream] = {}
    host_tiers: dict[int, HostTierReplay] = {}
    frontend: list[tuple[int, dict]] = []
    errors: list[str] = []
    for index, event in enumerate(events, 1):
        errors += [f"event #{index}: {e}" for e in schema.schema_errors(event)]
        name = event.get("event")
        if name in HOST_TIER_EVENTS:
            host_tiers.setdefault(event.get("pid"), HostTierReplay()).feed(index, event)
        if name in FRONTEND_EVENTS:
            frontend.append((index, event))
        elif name in REPLAYED_EVENTS:
            if not isinstance(event.get("uid"), int):
                errors.append(f"event #{index}: {name} without an integer uid")
                continue
            pid = event.get("pid")
            stream = streams.get(pid)
            if stream is None:
                stream = streams[pid] = SchedulerStream(pid)
            stream.feed(index, event)
    requests: list[RequestCheck] = []
    slot_events: list[tuple[int, str, int, int]] = []
    for pid, tier in host_tiers.items():
        errors += [f"scheduler pid {pid}: {e}" for e in tier.errors]
        if pid in streams:  # the tier's cache_load / cache_evict join that process's slot replay
            streams[pid].slot_events += tier.slot_events
    for stream in streams.values():
        requests += stream.finish(len(events))
        errors += [f"scheduler pid {stream.pid}: {e}" for e in stream.errors]
        slot_events += stream.slot_events
    _check_frontend(frontend, streams, errors)
    slot_events.sort(key=lambda e: e[0])
    return TraceReport(requests, errors, len(events), slot_events)


def _check_frontend(
    frontend: list[tuple[int, dict]], streams: dict[int, SchedulerStream], errors: list[str]
) -> None:
    """received / tokenized / detokenized come from other processes, so only their counts and
    contents are checked, not their place in the file."""
    by_uid: dict[int, list[RequestCheck]] = {}
    for stream in streams.values():
        for r in stream.requests.values():
            by_uid.setdefault(r.check.uid, []).append(r.check)
    seen: dict[tuple[int, str], int] = {}
    for index, event in frontend:
        uid, name = event.get("uid"), event.get("event")
        checks = by_uid.get(uid)
        if name == schema.DETOKENIZED.name:
            continue
        key = (uid, name)
        seen[key] = seen.get(key, 0) + 1
        if checks is None:
            continue  # refused before the scheduler (tokenizer error, validation): nothing to compare
        if seen[key] > len(checks):
            checks[-1].errors.append(f"event #{index}: {name} more than once")
        if name == schema.TOKENIZED.name and all(c.prompt_len != event.get("prompt_len") for c in checks):
            checks[-1].errors.append(
                f"event #{index}: tokenized prompt_len {event.get('prompt_len')!r}, "
                f"the scheduler queued {checks[-1].prompt_len}"
            )


def check_file(path: str) -> TraceReport:
    from minfer.observability.trace import read_trace

    return check_events(read_trace(path))


def format_report(report: TraceReport, max_errors: int = 3) -> str:
    """The pass/fail table, one line per request, then the errors of the failed ones."""
    header = (
        "uid",
        "prompt",
        "hit",
        "prefill",
        "chunks",
        "decode",
        "output",
        "preempt",
        "end",
        "final c/d/e",
        "check",
    )
    rows = [header]
    for r in sorted(report.requests, key=lambda r: (r.pid, r.uid)):
        rows.append(
            (
                str(r.uid),
                str(r.prompt_len),
                str(r.hit_tokens),
                str(r.prefill_slots),
                str(r.prefill_chunks),
                str(r.decode_steps),
                str(r.output_len),
                str(r.preemptions),
                r.end or "-",
                fmt_state(r.final_state),
                "PASS" if r.ok else "FAIL",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    for r in report.failed:
        lines.append(
            f"uid {r.uid}: "
            + "; ".join(r.errors[:max_errors])
            + (f"; ... {len(r.errors) - max_errors} more" if len(r.errors) > max_errors else "")
        )
    lines += report.errors[:20]
    n_failed = len(report.failed)
    verdict = "PASS" if report.ok else "FAIL"
    lines.append(
        f"{verdict}: {len(report.requests) - n_failed}/{len(report.requests)} requests pass, "
        f"{len(report.errors)} trace-level error(s), {report.num_events} events"
    )
    return "\n".join(lines)
