"""Moving KV pages between the device pool and the host pool, and counting what moved.

Pages are copied as raw tensor rows (`dst.k[layer][a:b].copy_(src.k[layer][c:d])`), never
through `KVPool.gather`, so whatever the pool stores (a low-bit cache included) comes back
bit for bit. Runs of consecutive slots on both sides go in one copy per layer and tensor.

Ordering on CUDA, the whole argument for correctness:
  - offloads run on the current (compute) stream: they read a page after every pass already
    queued that writes it, and a pass queued later that reuses the freed page writes it after
    the copy has read it. Nothing on the CPU ever reads the pinned destination;
  - a load runs on its own stream, which first waits for everything queued on the compute
    stream so far (earlier offloads into the host pages it reads, earlier passes still using
    the device pages it was just given). Passes queued afterwards overlap with it. The
    scheduler runs a request only once its load's event has completed (`done`), and any
    eviction of a node whose load is still in flight waits for it first (`wait`).
On CPU every copy is synchronous and `load` returns no pending load.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from minfer.kvcache.host_pool import HostKVPool
from minfer.kvcache.pool import KVPool
from minfer.observability.metric_names import HOST_LOAD_BUCKETS


@dataclass
class HostTierCounters:
    """Running totals the metrics exporter reads (a histogram as cumulative bucket counts)."""

    hits: int = 0  # prefix matches that loaded at least one page from the host tier
    tokens_loaded: int = 0
    bytes_loaded: int = 0
    bytes_offloaded: int = 0
    tokens_offloaded: int = 0
    loads: int = 0  # loads whose time is known (finished)
    load_waits: int = 0  # times a request was passed over because its load was still in flight
    load_seconds_sum: float = 0.0
    load_seconds_buckets: list[int] = field(default_factory=lambda: [0] * len(HOST_LOAD_BUCKETS))

    def observe_load(self, seconds: float) -> None:
        self.loads += 1
        self.load_seconds_sum += seconds
        for i, bound in enumerate(HOST_LOAD_BUCKETS):
            if seconds <= bound:
                self.load_seconds_buckets[i] += 1


@dataclass
class PendingLoad:
    """A host->device copy queued on the load stream (CUDA only)."""

    seq: int  # issue order: one stream, so a later load's completion implies an earlier one's
    start: torch.cuda.Event
    end: torch.cuda.Event
    observed: bool = False


def copy_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the maximal runs consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class HostTier:
    """The device pool, its host mirror, and the copies between them."""

    def __init__(self, device_pool: KVPool, host_pool: HostKVPool):
        self.device_pool = device_pool
        self.host = host_pool
        self.cuda = device_pool.k[0].is_cuda
        self.load_stream = torch.cuda.Stream(device_pool.k[0].device) if self.cuda else None
        self.counters = HostTierCounters()
        self._seq = 0

    def _copy(self, src_pool, dst_pool, src: list[int], dst: list[int]) -> None:
        runs = copy_runs(src, dst)
        for src_layers, dst_layers in ((src_pool.k, dst_pool.k), (src_pool.v, dst_pool.v)):
            for s_t, d_t in zip(src_layers, dst_layers):
                for s, d, n in runs:
                    d_t[d : d + n].copy_(s_t[s : s + n], non_blocking=self.cuda)

    def offload(self, device_slots: list[int], host_slots: list[int]) -> None:
        """Device -> host, queued on the compute stream (see the module docstring)."""
        self._copy(self.device_pool, self.host, device_slots, host_slots)
        self.counters.tokens_offloaded += len(device_slots)
        self.counters.bytes_offloaded += len(device_slots) * self.host.bytes_per_token

    def load(self, host_slots: list[int], device_slots: list[int]) -> PendingLoad | None:
        """Host -> device; on CUDA queued on the load stream, returning what to wait for."""
        c = self.counters
        c.hits += 1
        c.tokens_loaded += len(host_slots)
        c.bytes_loaded += len(host_slots) * self.host.bytes_per_token
        if not self.cuda:
            start = time.perf_counter()
            self._copy(self.host, self.device_pool, host_slots, device_slots)
            c.observe_load(time.perf_counter() - start)
            return None
        self.load_stream.wait_stream(torch.cuda.current_stream())
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.load_stream):
            start.record()
            self._copy(self.host, self.device_pool, host_slots, device_slots)
            end.record()
        self._seq += 1
        return PendingLoad(self._seq, start, end)

    def done(self, load: PendingLoad | None) -> bool:
        """Whether the load has finished (never blocks); records its time once."""
        if load is None:
            return True
        if not load.end.query():
            self.counters.load_waits += 1
            return False
        self._observe(load)
        return True

    def wait(self, load: PendingLoad | None) -> None:
        """Block until the load has finished (an eviction of pages still being written)."""
        if load is not None:
            load.end.synchronize()
            self._observe(load)

    def _observe(self, load: PendingLoad) -> None:
        if not load.observed:
            load.observed = True
            self.counters.observe_load(load.start.elapsed_time(load.end) / 1000.0)
