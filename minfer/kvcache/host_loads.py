"""The host tier's loads in flight (CUDA only): when each lands, and how long a pass that waits
for one on the device would wait.

Loads run in issue order on one stream (kvcache/host_tier.py), so they land in that order and
the queue is polled from its head. A prefill pass may take a request whose load has not landed
yet, making the compute stream wait for it (an event wait on the GPU, never on the CPU), when
the load is expected to land within about the time the CPU takes to launch the pass anyway
(scheduler/prefill.py): the estimate is the bytes still queued up to and including that load
over the bandwidth loads have reached so far.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

# Before any load has been timed: a cautious host->device rate (a pinned copy reaches ~25 GB/s
# on PCIe 4.0 x16 and ~55 GB/s on an H200's PCIe 5.0).
DEFAULT_LOAD_BANDWIDTH = 20e9


@dataclass
class PendingLoad:
    """A host->device copy queued on the load stream."""

    seq: int  # issue order: one stream, so a later load's completion implies an earlier one's
    start: torch.cuda.Event
    end: torch.cuda.Event
    num_bytes: int
    # The end of the offload D2H into one of its host pages that it waits for (host_tier.py rule
    # 4), if that was still in flight when the load was issued.
    after: torch.cuda.Event | None = None
    landed: bool = False  # seen complete, its time counted
    joined: bool = False  # the compute stream waits for it (order_compute_after)


class LoadQueue:
    """Loads not yet seen landed, oldest first; `counters` (HostTierCounters) gets their times."""

    def __init__(self, counters):
        self.counters = counters
        self.in_flight: deque[PendingLoad] = deque()
        self._seq = 0

    def issue(
        self, start: torch.cuda.Event, end: torch.cuda.Event, num_bytes: int, after: torch.cuda.Event | None
    ) -> PendingLoad:
        self._seq += 1
        load = PendingLoad(self._seq, start, end, num_bytes, after)
        self.in_flight.append(load)
        return load

    def poll(self) -> None:
        """Count every load that has landed since the last poll (never blocks)."""
        while self.in_flight and (self.in_flight[0].landed or self.in_flight[0].end.query()):
            self.land(self.in_flight.popleft())

    def land(self, load: PendingLoad) -> None:
        """The load has completed: count its time, once."""
        if not load.landed:
            load.landed = True
            self.counters.observe_load(load.start.elapsed_time(load.end) / 1000.0, load.num_bytes)

    def has_landed(self, load: PendingLoad) -> bool:
        self.poll()
        return load.landed

    def expected_wait(self, load: PendingLoad) -> float:
        """Seconds until `load` lands, estimated: the bytes of it and of every load queued before
        it still in flight, over the bandwidth measured on the loads timed so far. 0 once it has
        landed or the compute stream already waits for it; infinite while it still waits for an
        offload's copy-out (not estimated: the offload stream's queue is not)."""
        self.poll()
        if load.landed or load.joined:
            return 0.0
        if load.after is not None and not load.after.query():
            return float("inf")
        pending = sum(ld.num_bytes for ld in self.in_flight if ld.seq <= load.seq)
        c = self.counters
        bandwidth = (
            c.load_bytes_timed / c.load_seconds_sum if c.load_seconds_sum > 0 else DEFAULT_LOAD_BANDWIDTH
        )
        return pending / bandwidth

    def order_compute_after(self, load: PendingLoad, device: torch.device) -> None:
        """Make the compute (current) stream wait on the GPU for `load`: what is queued on it
        from now on runs after the copy (once per load: later passes follow the first)."""
        if load.joined:
            return
        load.joined = True
        self.counters.loads_joined += 1
        torch.cuda.current_stream(device).wait_event(load.end)
