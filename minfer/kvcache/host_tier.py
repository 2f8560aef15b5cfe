"""Moving KV pages between the device pool and the host pool, and counting what moved.

A transfer moves whole pages as raw bytes (never through `KVPool.gather_heads`, so whatever the pool
stores, an fp8 cache included, comes back bit for bit), through a device staging buffer laid
out like host pages (minfer/kvcache/host_pool.py: one page = one contiguous block across all
layers). Pages are sorted by host page, so each run of consecutive host pages is ONE
host<->device copy whatever the device pages are; the device side is ONE `index_copy_` (load)
or `index_select` (offload) over every layer's K and V at once (the pool is one tensor, seen
page-major by `device_page_view`), moving rows as 8-byte words where they divide. One kernel
per chunk, not one per layer and K/V: issuing Llama-8B's 64 per chunk cost ~3 ms of CPU per
load and per offload on an H200 host, on the critical path of every tiered admission.
A transfer bigger than a staging buffer goes in chunks of `staging_pages`.

  load     host --H2D (one copy per host run)--> load staging --index_copy_--> device pool
  offload  device pool --index_select--> offload staging --D2H (one per host run)--> host

Ordering on CUDA, the whole argument for correctness. Three streams: the compute stream (the
current stream: forward passes, and the offload gathers), the load stream, the offload stream.
  1. An offload's gather runs on the compute stream: it reads a device page after every pass
     already queued that writes it, and a pass queued later that reuses the freed page writes
     it after the gather has read it. The device pages are free for reuse at once.
  2. Its D2H runs on the offload stream after an event recorded behind the gather, so it reads
     the staging buffer once the gather has filled it; passes queued later overlap with it.
  3. The two offload staging buffers alternate. Before the compute stream gathers into one it
     waits (on the GPU, never on the CPU) for the event recorded behind that buffer's last D2H,
     so a gather never overwrites bytes still being copied out.
  4. A load first makes the load stream wait for everything queued so far on the compute stream
     (passes still using the device pages it was just given; gathers of pages since freed).
     On the offload stream it waits only for the D2H copies into the host pages it reads: each
     host page records the offload chunk that last wrote it (a sequence number in issue order),
     and the load waits for the end event of the latest such chunk, which on one stream implies
     every earlier chunk's, or for nothing once that chunk has completed. So a load does not
     queue behind the D2H of the eviction that just made room for it (other host pages).
     Passes queued afterwards overlap with it. Its H2D copies and scatters use the one load
     staging buffer in stream order, so a chunk's H2D cannot overwrite the previous chunk
     before its scatter read it.
  5. A pass reads pages a load writes only once the load's end event has completed (`done`),
     or after the compute stream was made to wait for that event (`order_compute_after`): a
     request whose load will land soon joins a pass so (host_loads.py), and so does a request
     repointed to a node still loading when its computed prompt is cached (its own pages
     duplicated the node's). Any eviction of a node whose load is still in flight waits for it
     first (`wait`), so a device page (or the host page it came from) never changes hands
     under a copy.
  6. Host pages are written only by D2H copies on the offload stream, in issue order (two
     copies into one page land in that order), and read only by loads, which rule 4 orders
     after the last copy into every page they read; the CPU never reads them. A host page is
     freed, and so can be written again by a later offload, only after every load reading it
     finished (rule 5): no copy overwrites a page a load still reads.
  7. Index tensors go to the device through pinned memory with non-blocking copies on the
     stream that uses them: a blocking copy would stall the CPU until that stream caught up.
     Staging buffers and the device pool are marked used by the side streams (record_stream),
     so memory freed at shutdown is not handed out again before those streams are done.
On CPU the same code runs synchronously (the staging buffers are host tensors) and `load`
returns no pending load.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from minfer.kvcache.host_loads import LoadQueue, PendingLoad
from minfer.kvcache.host_pool import HostKVPool, device_page_view
from minfer.kvcache.pool import KVPool
from minfer.observability.metric_names import HOST_LOAD_BUCKETS

# Bytes of one staging buffer: a chunk's H2D (~2.4 ms at 55 GB/s at 128 MiB) dwarfs its one
# scatter kernel, and three buffers are a small part of a device pool.
STAGING_BYTES = 128 << 20
STAGING_BUFFERS = 3  # one for loads (one stream: used in order), two alternating for offloads


def staging_pages(page_bytes: int, host_pages: int) -> int:
    """Pages one staging buffer holds: STAGING_BYTES' worth, at least one, at most the host pool."""
    return max(1, min(host_pages, STAGING_BYTES // page_bytes))


def staging_bytes(page_bytes: int, host_pages: int) -> int:
    """Device bytes the tier's staging buffers take (the memory budget sets them aside)."""
    return STAGING_BUFFERS * staging_pages(page_bytes, host_pages) * page_bytes


@dataclass
class HostTierCounters:
    """Running totals the metrics exporter reads (a histogram as cumulative bucket counts)."""

    hits: int = 0  # prefix matches that loaded at least one page from the host tier
    tokens_loaded: int = 0
    bytes_loaded: int = 0
    bytes_offloaded: int = 0
    tokens_offloaded: int = 0
    tokens_written_through: int = 0  # of those, copied on a hit (kvcache/write_policy.py)
    loads: int = 0  # loads whose time is known (finished)
    load_bytes_timed: int = 0  # their bytes: load bandwidth = this / load_seconds_sum
    load_waits: int = 0  # times a request sat out a pass because its load was still in flight
    loads_joined: int = 0  # loads in flight a pass was queued after on the GPU (host_loads.py)
    load_seconds_sum: float = 0.0
    load_seconds_buckets: list[int] = field(default_factory=lambda: [0] * len(HOST_LOAD_BUCKETS))
    offload_copies: int = 0  # offload chunks whose D2H time is known (finished)
    offload_bytes_timed: int = 0  # their bytes: offload bandwidth = this / offload_seconds_sum
    offload_seconds_sum: float = 0.0  # CUDA: the D2H copies on the offload stream; CPU: the copy

    def observe_load(self, seconds: float, num_bytes: int) -> None:
        self.loads += 1
        self.load_bytes_timed += num_bytes
        self.load_seconds_sum += seconds
        for i, bound in enumerate(HOST_LOAD_BUCKETS):
            if seconds <= bound:
                self.load_seconds_buckets[i] += 1


@dataclass
class OffloadStaging:
    """An offload staging buffer and the event behind its last D2H copy (None: never used)."""

    buffer: torch.Tensor
    drained: torch.cuda.Event | None = None


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
    """The device pool, its host mirror, the staging buffers and the copies between them."""

    def __init__(
        self, device_pool: KVPool, host_pool: HostKVPool, staging_pages_per_buffer: int | None = None
    ):
        self.device_pool = device_pool
        self.host = host_pool
        self.page_size = host_pool.page_size
        self.device = device_pool.k[0].device
        self.cuda = self.device.type == "cuda"
        self.dev_pages = device_page_view(device_pool, self.page_size)
        self.staging_pages = staging_pages_per_buffer or staging_pages(
            host_pool.page_bytes, host_pool.num_pages
        )
        shape = (self.staging_pages, host_pool.page_bytes)

        def buffer() -> torch.Tensor:
            return torch.empty(shape, dtype=torch.uint8, device=self.device)

        self.load_staging = buffer()
        self.offload_staging = [OffloadStaging(buffer()), OffloadStaging(buffer())]
        self.staging_bytes = STAGING_BUFFERS * self.staging_pages * host_pool.page_bytes
        self._next_offload = 0
        self.load_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.offload_stream = torch.cuda.Stream(self.device) if self.cuda else None
        if self.cuda:  # memory these streams use is not reused, once freed, before they are done
            for t in (self.load_staging, device_pool.storage):
                t.record_stream(self.load_stream)
            for staging in self.offload_staging:
                staging.buffer.record_stream(self.offload_stream)
        # D2H chunks not yet seen finished, in issue order: (sequence number, start, end, bytes).
        self._offloads_in_flight: deque[tuple[int, torch.cuda.Event, torch.cuda.Event, int]] = deque()
        self._offload_seq = 0  # of the latest chunk issued
        self._offloads_done = 0  # every chunk up to this one has finished
        self._page_writer = [0] * host_pool.num_pages  # host page -> the chunk that last wrote it
        self.counters = HostTierCounters()
        self.loads = LoadQueue(self.counters)

    # -- the two directions, chunk by chunk ------------------------------------------------------
    def _pages(self, host_slots: list[int], device_slots: list[int]) -> tuple[list[int], list[int]]:
        """(host pages, device pages) of whole-page slot lists, paired, sorted by host page."""
        ps = self.page_size
        pairs = sorted(zip(host_slots[::ps], device_slots[::ps]))
        assert len(host_slots) == len(device_slots) == len(pairs) * ps, "transfers move whole pages"
        assert all(h % ps == 0 and d % ps == 0 for h, d in pairs), "a page's slots start at a page"
        return [h // ps for h, _ in pairs], [d // ps for _, d in pairs]

    def _index(self, pages: list[int]) -> torch.Tensor:
        index = torch.tensor(pages, dtype=torch.long)
        return index.pin_memory().to(self.device, non_blocking=True) if self.cuda else index

    def _host_runs(self, host_pages: list[int]) -> list[tuple[int, int, int]]:
        """(host page, staging row, pages) of each run of consecutive host pages of a chunk."""
        return copy_runs(host_pages, list(range(len(host_pages))))

    def _load_pages(self, host_pages: list[int], device_pages: list[int]) -> None:
        """Host -> load staging -> device pool, on the current stream (rule 4)."""
        for at in range(0, len(host_pages), self.staging_pages):
            chunk = host_pages[at : at + self.staging_pages]
            staged = self.load_staging[: len(chunk)]
            for h, row, n in self._host_runs(chunk):
                staged[row : row + n].copy_(self.host.data[h : h + n], non_blocking=self.cuda)
            index = self._index(device_pages[at : at + len(chunk)])
            self.dev_pages.index_copy_(0, index, self.host.page_layout(staged))

    def _offload_pages(self, device_pages: list[int], host_pages: list[int]) -> None:
        """Device pool -> offload staging (compute stream) -> host (offload stream), rules 1-3."""
        for at in range(0, len(host_pages), self.staging_pages):
            chunk = host_pages[at : at + self.staging_pages]
            staging = self.offload_staging[self._next_offload]
            self._next_offload = 1 - self._next_offload
            if staging.drained is not None:  # rule 3: its previous D2H has read it
                torch.cuda.current_stream(self.device).wait_event(staging.drained)
            staged = staging.buffer[: len(chunk)]
            index = self._index(device_pages[at : at + len(chunk)])
            torch.index_select(self.dev_pages, 0, index, out=self.host.page_layout(staged))
            if not self.cuda:
                self._write_host(chunk, staged)
                continue
            gathered = torch.cuda.Event()
            gathered.record()  # on the compute stream, behind the gather
            self.offload_stream.wait_event(gathered)  # rule 2
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.offload_stream):
                start.record()
                self._write_host(chunk, staged)
                end.record()
            staging.drained = end
            self._offload_seq += 1
            for h in chunk:
                self._page_writer[h] = self._offload_seq
            self._offloads_in_flight.append(
                (self._offload_seq, start, end, len(chunk) * self.host.page_bytes)
            )

    def _write_host(self, host_pages: list[int], staged: torch.Tensor) -> None:
        for h, row, n in self._host_runs(host_pages):
            self.host.data[h : h + n].copy_(staged[row : row + n], non_blocking=self.cuda)

    def _copy(self, src_pool, dst_pool, src: list[int], dst: list[int]) -> None:
        """One synchronous transfer between the pools, either way (the CPU path; a test's
        deferred load lands through here)."""
        if src_pool is self.host:
            self._load_pages(*self._pages(src, dst))
        else:
            host_pages, device_pages = self._pages(dst, src)
            self._offload_pages(device_pages, host_pages)

    # -- the interface the radix tree uses ---------------------------------------------------------
    def offload(self, device_slots: list[int], host_slots: list[int]) -> None:
        """Device -> host: gathered on the compute stream, copied out on the offload stream."""
        self._observe_offloads()  # here too, so the timings in flight stay few without loads
        host_pages, device_pages = self._pages(host_slots, device_slots)
        c = self.counters
        start = time.perf_counter()
        self._offload_pages(device_pages, host_pages)
        if not self.cuda:
            c.offload_copies += 1
            c.offload_bytes_timed += len(device_slots) * self.host.bytes_per_token
            c.offload_seconds_sum += time.perf_counter() - start
        c.tokens_offloaded += len(device_slots)
        c.bytes_offloaded += len(device_slots) * self.host.bytes_per_token

    def load(self, host_slots: list[int], device_slots: list[int]) -> PendingLoad | None:
        """Host -> device; on CUDA queued on the load stream, returning what to wait for."""
        c = self.counters
        c.hits += 1
        c.tokens_loaded += len(host_slots)
        c.bytes_loaded += len(host_slots) * self.host.bytes_per_token
        host_pages, device_pages = self._pages(host_slots, device_slots)
        if not self.cuda:
            start = time.perf_counter()
            self._load_pages(host_pages, device_pages)
            c.observe_load(time.perf_counter() - start, len(host_slots) * self.host.bytes_per_token)
            return None
        self.load_stream.wait_stream(torch.cuda.current_stream(self.device))  # rule 4
        writer = self._last_writer(host_pages)
        if writer is not None:
            self.load_stream.wait_event(writer)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.load_stream):
            start.record()
            self._load_pages(host_pages, device_pages)
            end.record()
        return self.loads.issue(start, end, len(host_slots) * self.host.bytes_per_token, writer)

    def _last_writer(self, host_pages: list[int]) -> torch.cuda.Event | None:
        """The end event of the latest offload chunk that wrote one of `host_pages`, if it has
        not finished yet (rule 4)."""
        self._observe_offloads()
        seq = max(self._page_writer[h] for h in host_pages)
        if seq <= self._offloads_done:
            return None
        # In flight: every chunk after _offloads_done is still queued, in issue order.
        return next(end for s, _, end, _ in self._offloads_in_flight if s == seq)

    def done(self, load: PendingLoad | None) -> bool:
        """Whether the load has finished (never blocks); records its time once."""
        self._observe_offloads()
        return load is None or self.loads.has_landed(load)

    def wait(self, load: PendingLoad | None) -> None:
        """Block until the load has finished (an eviction of pages still being written)."""
        if load is not None:
            load.end.synchronize()
            self.loads.land(load)

    def expected_wait(self, load: PendingLoad | None) -> float:
        """Seconds until the load lands, estimated (host_loads.py); 0 once it has."""
        return 0.0 if load is None else self.loads.expected_wait(load)

    def order_compute_after(self, load: PendingLoad | None) -> None:
        """Passes queued from now on wait for the load on the GPU (rule 5), not on the CPU."""
        if load is not None:
            self.loads.order_compute_after(load, self.device)

    def synchronize(self) -> None:
        """Block until every queued copy has finished and its time is counted (benchmarks)."""
        if self.cuda:
            self.load_stream.synchronize()
            self.offload_stream.synchronize()
            self._observe_offloads()

    def _observe_offloads(self) -> None:
        """Count the D2H time of finished offload chunks (in issue order: one stream), and the
        time of landed loads."""
        if self.cuda:
            self.loads.poll()
        c = self.counters
        while self._offloads_in_flight and self._offloads_in_flight[0][2].query():
            self._offloads_done, start, end, num_bytes = self._offloads_in_flight.popleft()
            c.offload_copies += 1
            c.offload_bytes_timed += num_bytes
            c.offload_seconds_sum += start.elapsed_time(end) / 1000.0
