"""Host-to-device copies that never stall the CPU behind the GPU.

A copy from ordinary (pageable) host memory makes CUDA wait for the stream before it starts,
so the CPU could not prepare step N+1 while the GPU runs step N. Copies from pinned memory
are truly asynchronous; torch's pinned-memory cache keeps each staging block alive until its
copy has run, so a block is never overwritten while queued.
"""

from __future__ import annotations

import torch


def to_device(
    values, dtype: torch.dtype, device: torch.device, out: torch.Tensor | None = None
) -> torch.Tensor:
    """A list (or CPU tensor) of numbers as a tensor on `device`, without a host sync on CUDA;
    copied into `out` (a tensor of that shape, dtype and device) when given."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if host.dtype != dtype:
        host = host.to(dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    if out is not None:
        return out.copy_(host, non_blocking=device.type == "cuda")
    return host.to(device, non_blocking=True) if device.type == "cuda" else host


def cpu_thread_count(requested: int | None, ranks_per_node: int = 1) -> int:
    """`--cpu-threads`; else OMP_NUM_THREADS when set to a number (the user's explicit
    choice); else the cores this process may run on (its affinity, which taskset, cgroups and
    container limits narrow, unlike os.cpu_count) shared among the node's tensor-parallel
    ranks. More threads than cores make them spin against each other: a 4-request decode step
    took 583-3,093 ms instead of 94 ms with one other busy process."""
    if requested is not None:
        return requested
    import os

    omp = os.environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        return int(omp)

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // ranks_per_node)


def set_gpu_host_threads(requested: int | None) -> int:
    """Set torch's intra-op threads for a process that runs the model on a GPU: 1 unless asked.

    Such a process does only bookkeeping with CPU tensors (per-token index vectors of a few
    thousand entries), which one thread does in microseconds. With the default (one thread per
    core) an op may wake the whole OpenMP pool, and on a shared host whose cores are busy
    that wait is milliseconds: on the H200 host a prefill pass's two 8192-entry
    `repeat_interleave`s took 1.5 ms each under cProfile (10 us on one thread here), while
    the GPU waited on the pass's launches (docs/PERFORMANCE.md, section 14)."""
    return _set_threads(requested or 1)


def _set_threads(threads: int) -> int:
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


def set_cpu_threads(requested: int | None, ranks_per_node: int = 1) -> int:
    """Set torch's intra-op threads for a process that runs the model on CPU; returns the count."""
    return _set_threads(cpu_thread_count(requested, ranks_per_node))
