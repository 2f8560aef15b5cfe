"""Host-to-device copies that never stall the CPU behind the GPU.

A copy from ordinary (pageable) host memory makes CUDA wait for the stream before it starts,
so the CPU could not prepare step N+1 while the GPU runs step N. Copies from pinned memory
are truly asynchronous; torch's pinned-memory cache keeps each staging block alive until its
copy has run, so a block is never overwritten while queued.
"""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list (or CPU tensor) of numbers as a tensor on `device`, without a host sync on CUDA."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if host.dtype != dtype:
        host = host.to(dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
