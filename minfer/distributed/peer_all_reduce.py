"""All-reduce of decode-sized activations over peer memory (torch symmetric memory), for TP
ranks on one host. Opt-in while it is unmeasured: MINFER_TP_ALL_REDUCE=peer.

Why: a decode step of Llama-3.1-8B at tp=2 does 65 all-reduces of [batch, 4096] bf16, and
NCCL's take 31 us each for 2 MiB against 4.4 us of NVLink bytes (docs/TP.md): they are bound
by latency, not by the links. Over peer memory a rank copies its partial into a buffer every
rank of the group can address, and one kernel reads every rank's buffer and sums them
(torch's one-shot all-reduce: a barrier over per-rank signal pads before the reads and
another after, so the buffer can be refilled by the next call). No host work, so it can sit
in a decode CUDA graph like NCCL's.

What stays on NCCL: tensors larger than the buffer (prefill chunks of more than 1,024 tokens
at hidden size 4096; shorter prefill steps take the peer path too), tensors whose byte size
is not a multiple of 16 (the kernel's vector width), dtypes other than bf16 and float32 (the
only two torch's kernel is built for), and everything off CUDA.

NVLink multicast (NVLS) is never used: the GPU host forbids it, so every rank process runs
with NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (set by
`disable_nvlink_multicast`, which join_tp_group calls before any communicator exists), and
the one-shot kernel reads peers with plain loads, not multimem instructions.

Every rank sums the ranks' partials in the same order (rank 0's first: torch's kernel loads
them by rank), so every rank gets the same bits and the ranks sample the same tokens
(docs/TP.md, "Token agreement").
"""

from __future__ import annotations

import logging
import os

import torch

from minfer.config import ConfigError

log = logging.getLogger(__name__)

ENV = "MINFER_TP_ALL_REDUCE"  # "nccl" (default) or "peer"
# One decode step's activations at most: [512 rows, 8192 hidden] bf16. Prefill chunks are
# larger and go to NCCL, whose ring reaches 67% of the links on large tensors.
DEFAULT_MAX_BYTES = 8 << 20
_VECTOR_BYTES = 16
_DTYPES = (torch.bfloat16, torch.float32)
_STORE_KEY = "minfer/all_reduce"
# torch keeps symmetric-memory state per process (group names, rendezvous caches); a second TP
# job in one process (the offline API allows it) would meet fresh followers with stale state.
_used_in_process = False


def disable_nvlink_multicast() -> None:
    """NCCL and torch's symmetric memory leave NVLink multicast alone in this process and in the
    rank processes it starts (inherited environment). A user's explicit setting wins."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


def requested() -> str:
    """Which all-reduce the environment asks for; a clear error (one line from the CLI) for
    anything else."""
    choice = os.environ.get(ENV, "nccl")
    if choice not in ("nccl", "peer"):
        raise ConfigError(f"{ENV}={choice!r}: expected 'nccl' or 'peer'")
    return choice


def agreed_kind(store, rank: int, nnodes: int) -> str:
    """The all-reduce of this TP job, the same on every rank: rank 0 reads the environment and
    publishes its choice in the job's store, the other ranks take it from there (a group split
    between the two would wait forever in the peer buffer's rendezvous)."""
    if rank != 0:
        return store.get(_STORE_KEY).decode()
    kind = requested()
    if kind == "peer" and nnodes > 1:
        raise ConfigError(f"{ENV}=peer needs every rank on one host; this job spans {nnodes} nodes")
    if kind == "peer" and _used_in_process:
        log.warning("%s=peer: only the first TP job of a process uses peer memory; this one uses NCCL", ENV)
        kind = "nccl"
    store.set(_STORE_KEY, kind)
    return kind


class PeerAllReduce:
    """One symmetric byte buffer per rank, viewed as whatever dtype a call brings."""

    def __init__(self, group, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES):
        import torch.distributed._symmetric_memory as symm_mem

        global _used_in_process
        _used_in_process = True
        self.group_name = group.group_name
        self.max_bytes = max_bytes
        # Collective: every rank of the group allocates and exchanges handles at this point.
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        ops = torch.ops.symm_mem
        # The copy-in variant saves a launch per call; older torch builds have only the plain op.
        self._copy_in = getattr(ops, "one_shot_all_reduce_copy", None)
        self._reduce = ops.one_shot_all_reduce

    def suits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        # the kernel needs x's start aligned as the buffer's (offset 0), and whole vectors
        aligned = (x.storage_offset() * x.element_size()) % _VECTOR_BYTES == 0 and nbytes % _VECTOR_BYTES == 0
        return x.is_cuda and x.dtype in _DTYPES and 0 < nbytes <= self.max_bytes and aligned

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x (a new tensor of x's shape and dtype)."""
        flat = x.reshape(-1)
        staged = self.buffer[: flat.numel() * flat.element_size()].view(flat.dtype)
        if self._copy_in is not None:
            out = self._copy_in(staged, flat, "sum", self.group_name)
        else:
            staged.copy_(flat)
            out = self._reduce(staged, "sum", self.group_name)
        return out.view(x.shape)
