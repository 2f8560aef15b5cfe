"""Request traces: one JSON line per event of a request's life, written off the hot path.

Every line has `ts` (seconds, time.time()), `uid`, `pid`, `event`, and the event's fields; the
schema is docs/TRACE.md. When tracing is off the tracer is `NULL_TRACER`, whose `enabled` is
False: call sites test it before building any event, so an untraced run pays one attribute
read per site. When on, events go to a queue and a writer thread serialises and writes them
in batches, appending to the file (several processes may share one file: each line is written
with a single O_APPEND write).
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import threading
import time


class RequestTracer:
    def __init__(self, path: str | None):
        self.enabled = path is not None
        self.path = path
        self.pid = os.getpid()
        if not self.enabled:
            return
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._thread = threading.Thread(target=self._write_loop, name="minfer-trace", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def emit(self, event: str, uid: int, **fields) -> None:
        """Queue one event; callers check `enabled` first so that untraced runs build nothing."""
        fields.update(ts=time.time(), uid=uid, pid=self.pid, event=event)
        self._queue.put(fields)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            batch = [item]
            while True:  # drain whatever else is queued into one write
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = None in batch
            lines = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in batch if e is not None)
            if lines:
                os.write(self._fd, lines.encode())
            if stop:
                return

    def close(self) -> None:
        """Flush every queued event and close the file (idempotent)."""
        if not self.enabled or self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout=10)
        os.close(self._fd)
        self._thread = None


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
