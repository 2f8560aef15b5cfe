"""The host KV pool: the second cache tier's storage, one K and one V tensor per layer in host memory.

Rows mirror the device pool's (minfer/kvcache/pool.py) exactly: same per-layer row shape and the
same dtype as the device tensors hold, whatever that is (a low-bit cache stores raw rows, so
pages move between tiers as raw bytes and nothing is ever decoded on the way). On CUDA the
tensors are pinned so host<->device copies are asynchronous DMA transfers; on CPU they are
plain tensors and the same code copies synchronously.
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


class HostKVPool:
    """Host pages of `page_size` slots; `allocator` hands them out like the device allocator."""

    def __init__(self, device_pool: KVPool, num_slots: int, page_size: int, pin: bool):
        self.num_slots = num_slots
        self.page_size = page_size
        self.bytes_per_token = row_bytes(device_pool)
        self.allocator = PageAllocator(num_slots // page_size, page_size)

        def mirror(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros((num_slots, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)

        self.k = [mirror(t) for t in device_pool.k]
        self.v = [mirror(t) for t in device_pool.v]

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
        num_slots = want // per_token // page_size * page_size
        if num_slots == 0:
            raise ConfigError(
                f"--host-kv-cache-gb={gib} holds no page ({page_size} tokens x {per_token} B/token)"
            )
        return cls(device_pool, num_slots, page_size, pin)
