"""Request traces: one JSON line per event of a request's life, written off the hot path.

Every line has `ts` (seconds, time.time()), `pid`, `uid`, `event`, and the event's fields; the
schema is minfer/observability/events.py (docs/TRACE.md renders it). When tracing is off the
tracer is `NULL_TRACER`, whose `enabled` is False: call sites test it before building any
event, so an untraced run pays one attribute read per site. When on, `emit` only puts a tuple
on a queue; a writer thread wakes every `FLUSH_INTERVAL_S`, serialises what accumulated and
writes it with one O_APPEND write, so several processes (api server, tokenizer, detokenizer,
scheduler) may share one file without tearing lines.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import threading
import time

from minfer.observability.events import EventSpec

# How often the writer thread drains the queue. Waking per event would make the writer compete
# with the scheduler thread for the GIL on every emit; a batch every 50 ms costs one wake-up.
FLUSH_INTERVAL_S = 0.05


class RequestTracer:
    """Buffered JSONL writer of request events. `RequestTracer(None)` is disabled and writes nothing.

    The file is opened for appending; `truncate=True` empties it first (the process that starts
    a run does this once, so that a trace holds one run: uids restart at 0 in every run).
    """

    def __init__(self, path: str | None, truncate: bool = False):
        self.enabled = path is not None
        self.path = path
        self.pid = os.getpid()
        self._thread: threading.Thread | None = None
        if not self.enabled:
            return
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
        self._fd = os.open(path, flags, 0o644)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._write_lock = threading.Lock()  # `flush` may drain from another thread: keep file order
        self._thread = threading.Thread(target=self._write_loop, name="minfer-trace", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def emit(self, event: EventSpec, uid: int, **fields) -> None:
        """Queue one event; callers check `enabled` first so that untraced runs build nothing.

        `event` is a declared spec of minfer.observability.events, not a string: a misspelt name
        fails here. Its fields are checked against the spec by `minfer trace check`, not here,
        to keep an emit one queue put."""
        self._queue.put((time.time(), uid, event.name, fields))

    def _write_loop(self) -> None:
        while not self._stop.wait(FLUSH_INTERVAL_S):
            self._drain()
        self._drain()

    def _drain(self) -> None:
        dumps = json.JSONEncoder(separators=(",", ":")).encode
        with self._write_lock:
            lines = []
            while True:
                try:
                    ts, uid, event, fields = self._queue.get_nowait()
                except queue.Empty:
                    break
                lines.append(dumps({"ts": ts, "pid": self.pid, "uid": uid, "event": event, **fields}))
            if lines:
                data = ("\n".join(lines) + "\n").encode()
                while data:  # a regular file takes it in one write; loop in case it does not
                    data = data[os.write(self._fd, data) :]

    def flush(self) -> None:
        """Write whatever is queued now (from the calling thread; the writer may be mid-batch)."""
        if self._thread is not None:
            self._drain()

    def close(self) -> None:
        """Flush every queued event and close the file (idempotent)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=10)
        self._thread = None
        os.close(self._fd)


NULL_TRACER = RequestTracer(None)


def slot_ranges(slots: list[int]) -> list[list[int]]:
    """[5, 6, 7, 10, 11] -> [[5, 8], [10, 12]]: half-open runs of consecutive slots."""
    ranges: list[list[int]] = []
    for s in slots:
        if ranges and ranges[-1][1] == s:
            ranges[-1][1] = s + 1
        else:
            ranges.append([s, s + 1])
    return ranges


def expand_ranges(ranges: list[list[int]]) -> list[int]:
    """The inverse of `slot_ranges`: [[5, 8], [10, 12]] -> [5, 6, 7, 10, 11]."""
    return [s for start, end in ranges for s in range(start, end)]


def read_trace(path: str) -> list[dict]:
    """Every event of a trace file, in file order. A torn last line (a process killed mid-write)
    is skipped; any other malformed line raises ValueError naming its line number."""
    events = []
    with open(path) as f:
        lines = f.read().split("\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a JSON line ({e.msg})") from None
    return events
