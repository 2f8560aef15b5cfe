"""Runs appended to one trace file, told apart.

An offline `LLM(trace_requests=FILE)` appends to FILE, and uids restart at 0 in every run, so two
runs in one file would merge into one request per uid (a queue time measured from the second
run's arrival to the first run's admission comes out negative). Every run's scheduler writes one
`kv_pool` event when it starts, before any request, so the kv_pool events mark where runs begin:
  - an event of a process that wrote kv_pool events belongs to the latest of them not after it
    (one process may start several runs, one after the other);
  - any other process (the api server, tokenizer and detokenizer of a served run) belongs to the
    run whose kv_pool came last before that process's first event: they start their work after
    the scheduler reported ready.
Timestamps, not file order, decide: processes flush their lines every 50 ms, out of order.
"""

from __future__ import annotations

import bisect

from minfer.observability import events as schema


def split_runs(events: list[dict]) -> list[list[dict]]:
    """The events of each run, in file order; a file with at most one kv_pool event is one run."""
    starts = sorted((e.get("ts", 0.0), e.get("pid")) for e in events if e.get("event") == schema.KV_POOL.name)
    if len(starts) <= 1:
        return [events]
    start_times = [ts for ts, _ in starts]
    own_starts: dict[object, list[tuple[float, int]]] = {}
    for run, (ts, pid) in enumerate(starts):
        own_starts.setdefault(pid, []).append((ts, run))
    first_seen: dict[object, float] = {}
    for e in events:
        pid, ts = e.get("pid"), e.get("ts", 0.0)
        first_seen[pid] = min(ts, first_seen.get(pid, ts))

    def run_of(e: dict) -> int:
        pid, ts = e.get("pid"), e.get("ts", 0.0)
        own = own_starts.get(pid)
        if own:
            index = bisect.bisect_right([t for t, _ in own], ts) - 1
            return own[max(index, 0)][1]
        return max(bisect.bisect_right(start_times, first_seen[pid]) - 1, 0)

    runs: list[list[dict]] = [[] for _ in starts]
    for e in events:
        runs[run_of(e)].append(e)
    return runs
