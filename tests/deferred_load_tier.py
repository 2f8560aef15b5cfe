"""A CPU stand-in for the host KV tier's CUDA load stream, for the tests of waiting on loads."""

from __future__ import annotations

import weakref

import torch

from minfer.kvcache.host_tier import HostTier

_TIERS: weakref.WeakSet = weakref.WeakSet()  # every stand-in alive, for the forward-pass hook


def use_deferred_loads(monkeypatch, mode: str = "wait", polls_in_flight: int | None = None) -> None:
    """Engines built from now on get a DeferredLoadTier. "wait": a request whose load is in
    flight sits out passes until it lands; "join": it joins the next pass, whose loads land
    when the pass starts, as a CUDA pass queued after them runs after them."""
    import minfer.scheduler.scheduler as scheduler_module
    from minfer.engine.engine import Engine

    monkeypatch.setattr(scheduler_module, "HostTier", DeferredLoadTier)
    monkeypatch.setattr(DeferredLoadTier, "EXPECTED_WAIT", 0.0 if mode == "join" else float("inf"))
    if polls_in_flight is not None:
        monkeypatch.setattr(DeferredLoadTier, "POLLS_IN_FLIGHT", polls_in_flight)
    forward = Engine.forward_batch
    if getattr(forward, "lands_joined_loads", False):  # hooked already (hypothesis examples)
        return

    def after_joined_loads(self, batch):
        for tier in list(_TIERS):
            tier.land_joined()
        return forward(self, batch)

    after_joined_loads.lands_joined_loads = True
    monkeypatch.setattr(Engine, "forward_batch", after_joined_loads)


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
        self.joined: list = []  # loads a pass was ordered after, still in flight until it starts
        _TIERS.add(self)

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
        if load is None or load.state[2] is None or load in self.joined:
            return 0.0
        return self.EXPECTED_WAIT

    def order_compute_after(self, load) -> None:
        # The copy stays in flight (evictions in between still settle it) until the next pass
        # starts (use_deferred_loads' hook), as a CUDA pass queued after it runs after it.
        if load is not None and load.state[2] is not None and load not in self.joined:
            self.counters.loads_joined += 1
            self.joined.append(load)

    def land_joined(self) -> None:
        for load in self.joined:
            self._land(load.seq)
        self.joined.clear()

    def _land(self, seq: int) -> None:
        for state in [s for s in self.in_flight if s[0] <= seq]:
            state[2]()
            state[2] = None
            self.in_flight.remove(state)
