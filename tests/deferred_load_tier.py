"""A CPU stand-in for the host KV tier's CUDA load stream, for the tests of waiting on loads."""

from __future__ import annotations

import torch

from minfer.kvcache.host_tier import HostTier


class DeferredLoadTier(HostTier):
    """A CPU stand-in for the CUDA load stream: a load's copy happens only when it lands, after
    it has been polled in flight a few times (or when an eviction waits for it), and loads land
    in issue order as on one stream. A request run before its load landed would read stale
    pages, so equal outputs show the scheduler really waits, and eviction really settles."""

    POLLS_IN_FLIGHT = 3
    # What expected_wait answers for a load in flight: infinite keeps a request out of every
    # pass until its load lands; 0 lets it join the next pass, which then "waits" for the copy.
    EXPECTED_WAIT = float("inf")

    def __init__(self, device_pool, host_pool):
        super().__init__(device_pool, host_pool)
        self.in_flight: list[list] = []  # [seq, polls left, copy or None]
        self._seq = 0

    def load(self, host_slots, device_slots):
        c = self.counters
        c.hits += 1
        c.tokens_loaded += len(host_slots)
        c.bytes_loaded += len(host_slots) * self.host.bytes_per_token
        # Until the copy lands the pages hold what a half-done copy might: garbage.
        index = torch.tensor(device_slots)
        for t in (*self.device_pool.k, *self.device_pool.v):
            t.index_fill_(0, index, 1e4)
        self._seq += 1
        load = [
            self._seq,
            self.POLLS_IN_FLIGHT,
            lambda: self._copy(self.host, self.device_pool, host_slots, device_slots),
        ]
        self.in_flight.append(load)
        return type("Load", (), {"seq": self._seq, "state": load})()

    def done(self, load) -> bool:
        if load is None or load.state[2] is None:
            return True
        if load.state[1] > 0:
            load.state[1] -= 1
            return False
        self._land(load.state[0])
        return True

    def wait(self, load) -> None:
        if load is not None:
            self._land(load.seq)

    def expected_wait(self, load) -> float:
        return 0.0 if load is None or load.state[2] is None else self.EXPECTED_WAIT

    def order_compute_after(self, load) -> None:
        # On one CPU "stream" the pass runs after the copy: the copy lands now.
        if load is not None and load.state[2] is not None:
            self.counters.loads_joined += 1
            self._land(load.seq)

    def _land(self, seq: int) -> None:
        for state in [s for s in self.in_flight if s[0] <= seq]:
            state[2]()
            state[2] = None
            self.in_flight.remove(state)
