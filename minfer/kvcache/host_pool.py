"""The host KV pool: the second cache tier's storage, page-major raw bytes in host memory.

Host page p is ONE contiguous block `data[p]` of `page_bytes` holding every layer's K and V
rows of its `page_size` slots, laid out [layer, k|v, slot in page, row bytes] (for a head-major
device pool [layer, k|v, kv head, slot in page, head row bytes]: see `transfer_units`). A run of
consecutive host pages is therefore one contiguous range, copied to or from the device in a
single transfer (minfer/kvcache/host_tier.py), where a per-layer layout would need one copy
per layer and K/V. The bytes are the device pool's rows as stored (any dtype: an fp8 cache's
raw bytes), so a page round-trips bit for bit and nothing is decoded on the way. On CUDA the
block is pinned so copies are asynchronous DMA transfers; on CPU it is a plain tensor.
"""

from __future__ import annotations

import os

import torch

from minfer.config import ConfigError
from minfer.kvcache.allocator import PageAllocator
from minfer.kvcache.pool import KVPool

GiB = 1 << 30


def host_available_bytes() -> int:
    """Host RAM the kernel could hand out now (MemAvailable: free plus reclaimable cache)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def row_bytes(device_pool: KVPool) -> int:
    """Bytes one token's K and V take across every layer, as the device pool stores them."""
    return sum(t[0].numel() * t.element_size() for t in (*device_pool.k, *device_pool.v))


def transfer_units(device_pool: KVPool) -> tuple[int, int]:
    """(units, row bytes): the storage as `units` blocks of one row per slot, the rows of
    consecutive slots adjacent. A slot-major pool has a unit per layer and K|V (a row: every
    head of a token); a head-major one a unit per layer, K|V and head (a row: one head)."""
    row = device_pool.head_dim * device_pool.storage.element_size()
    units = 2 * device_pool.num_layers
    if device_pool.head_major:
        return units * device_pool.num_kv_heads, row
    return units, row * device_pool.num_kv_heads


def transfer_word(device_pool: KVPool) -> torch.dtype:
    """The widest integer type a row's bytes divide into: device-side scatters and gathers move
    raw rows as these words, 8x fewer elements than bytes (the values are never read as such)."""
    rb = transfer_units(device_pool)[1]
    return next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8) if rb % w.itemsize == 0)


def device_page_view(device_pool: KVPool, page_size: int) -> torch.Tensor:
    """The device pool's storage seen as host-laid-out pages: [device page, unit, page_size *
    row words] (a strided view of the same memory; units: transfer_units, words: transfer_word).
    Page d of it holds what a host page holds for device page d, so a transfer of n pages is
    one index_select / index_copy_ along dim 0 against a [n, units, ...] staging block."""
    units, row = transfer_units(device_pool)
    word = transfer_word(device_pool)
    pages = device_pool.storage.view(torch.uint8).view(units, -1, page_size * row)
    return pages.view(word).transpose(0, 1)


class HostKVPool:
    """Host pages of `page_size` slots; `allocator` hands them out like the device allocator."""

    def __init__(self, device_pool: KVPool, num_slots: int, page_size: int, pin: bool):
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.bytes_per_token = row_bytes(device_pool)
        self.page_bytes = self.bytes_per_token * page_size
        self.allocator = PageAllocator(self.num_pages, page_size)
        # [page, unit, slot and row words]: what `page_layout` reshapes pages to.
        units, row = transfer_units(device_pool)
        self.word = transfer_word(device_pool)
        self.page_shape = (units, page_size * row // self.word.itemsize)
        self.data = torch.zeros((self.num_pages, self.page_bytes), dtype=torch.uint8, pin_memory=pin)
        # The same bytes typed as the device pool stores them, for reading (tests, debugging):
        # [page, layer, k|v, slot in page, kv head, dim] whatever the layout.
        heads, dim, layers = device_pool.num_kv_heads, device_pool.head_dim, device_pool.num_layers
        typed = self.data.view(device_pool.storage_dtype)
        if device_pool.head_major:
            self.pages = typed.view(self.num_pages, layers, 2, heads, page_size, dim).transpose(3, 4)
        else:
            self.pages = typed.view(self.num_pages, layers, 2, page_size, heads, dim)

    def page_layout(self, block: torch.Tensor) -> torch.Tensor:
        """A [n, page_bytes] uint8 block (host pages or a device staging buffer) as [n, unit, slot
        and row words], the shape of `device_page_view`'s pages."""
        return block.view(self.word).view(block.shape[0], *self.page_shape)

    @property
    def num_bytes(self) -> int:
        return self.num_slots * self.bytes_per_token

    @classmethod
    def sized(cls, device_pool: KVPool, gib: float, page_size: int, pin: bool) -> HostKVPool:
        """A pool of `gib` GiB (whole pages), refused if the host cannot spare it."""
        per_token = row_bytes(device_pool)
        want = int(gib * GiB)
        available = host_available_bytes()
        if want > available:
            raise ConfigError(
                f"--host-kv-cache-gb={gib}: the host has only {available / GiB:.2f} GiB available"
            )
        num_slots = host_pool_pages(gib, per_token, page_size) * page_size
        if num_slots == 0:
            raise ConfigError(
                f"--host-kv-cache-gb={gib} holds no page ({page_size} tokens x {per_token} B/token)"
            )
        return cls(device_pool, num_slots, page_size, pin)


def host_pool_pages(gib: float, bytes_per_token: int, page_size: int) -> int:
    """Whole pages a host pool of `gib` GiB holds."""
    return int(gib * GiB) // bytes_per_token // page_size
