"""Tensor-parallel group: which rank this process is, and the collectives the layers use.

With world size 1 every collective is the identity, so the same layers serve TP=1 and TP=N.

A TP job of N ranks has two process groups:
  group      the device group the layers' all-reduce / all-gather run on (NCCL on CUDA, gloo
             on CPU), with torch's default timeout;
  cpu_group  a gloo group for the scheduler's per-step broadcast and start-up agreement. Its
             timeout is effectively infinite because followers legitimately wait there for as
             long as the server is idle; a dead peer still fails it at once (gloo sees the
             closed socket).
All-reduces of up to 8 MiB (decode steps) can go over peer memory instead of NCCL (peer_all_reduce.py, opt-in).
Ranks meet through a TCPStore at `--dist-init-addr` (rank 0 listens). Rank 0 waits for the
others in Python, so it can give up with a clear error when a rank it started has died.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minfer.config import ConfigError
from minfer.device import set_cpu_threads
from minfer.distributed import peer_all_reduce

# How long ranks wait for each other to show up (loading is not included: ranks meet first).
RENDEZVOUS_TIMEOUT_S = 600
# Followers wait in the control broadcast while the server is idle: forever, for practical purposes.
CONTROL_TIMEOUT = datetime.timedelta(days=3650)


# torch 2.13 renamed all_gather_into_tensor (same arguments); the GPU hosts run 2.11.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed, so the whole group stops."""


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object | None = None  # the device ProcessGroup when size > 1
    cpu_group: object | None = None  # the gloo ProcessGroup for Python objects when size > 1
    local_rank: int = 0  # index among this node's ranks: the CUDA device this rank uses
    peer: peer_all_reduce.PeerAllReduce | None = None  # all-reduces up to 8 MiB over peer memory (opt-in)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x: in place (NCCL, gloo) or a new tensor (peer memory)."""
        if self.size > 1:
            if self.peer is not None and self.peer.suits(x):
                return self.peer(x)
            dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's shard along the last dimension, in rank order."""
        if self.size == 1:
            return x
        # One flat gather (a single NCCL kernel, also under CUDA graph capture), then the rank
        # dimension moves next to the last one: [size, ..., n] -> [..., size * n].
        gathered = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_flat(gathered, x.contiguous(), group=self.group)
        return (
            gathered.view(self.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])
        )

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. the KV pool size each rank can afford)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's `data` on every rank (others pass None)."""
        box = [data]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]


SINGLE = TPGroup()


@dataclass(frozen=True)
class RankLayout:
    """Where each rank of a `--tp N --nnodes M` job runs: N/M consecutive ranks per node."""

    tp: int
    nnodes: int
    node_rank: int

    @classmethod
    def of(cls, config) -> RankLayout:
        layout = cls(config.tp, config.nnodes, config.node_rank)
        if layout.tp < 1:
            raise ValueError(f"tp={layout.tp} must be at least 1")
        if layout.nnodes < 1 or layout.tp % layout.nnodes:
            raise ValueError(f"tp={layout.tp} must be a multiple of nnodes={layout.nnodes} (ranks per node)")
        if not 0 <= layout.node_rank < layout.nnodes:
            raise ValueError(f"node_rank={layout.node_rank} must be in [0, nnodes={layout.nnodes})")
        if layout.nnodes > 1 and not config.dist_init_addr:
            raise ValueError("nnodes > 1 needs dist_init_addr=HOST:PORT (node 0's address) on every node")
        return layout

    @property
    def per_node(self) -> int:
        return self.tp // self.nnodes

    @property
    def node_ranks(self) -> list[int]:
        return list(range(self.node_rank * self.per_node, (self.node_rank + 1) * self.per_node))

    def check_gpus(self, visible: int) -> None:
        """One GPU per rank of a node (its local rank r takes GPU r). Checked before any rank
        meets the others: with too few GPUs a rank failed only at set_device, after rank 0 had
        counted it as joined, and rank 0 then waited in NCCL's rendezvous for it."""
        if visible >= self.per_node:
            return
        where = f"each of the {self.nnodes} nodes runs" if self.nnodes > 1 else "this machine runs"
        raise ConfigError(
            f"--tp {self.tp}: {where} {self.per_node} ranks, one GPU each, but torch sees {visible} "
            f"GPU{'' if visible == 1 else 's'} here (CUDA_VISIBLE_DEVICES chooses them; "
            "--device cpu runs the ranks on the CPU)"
        )


def split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"dist_init_addr={addr!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def create_store(config, rank: int, listener: socket.socket | None = None) -> dist.TCPStore:
    """Rank 0 listens at `config.dist_init_addr` (port 0: any free port, read back from
    `store.port`), or on `listener`, a socket already listening there, which the store then
    owns; other ranks connect there, retrying until rank 0 is up."""
    host, port = split_addr(config.dist_init_addr or "127.0.0.1:0")
    timeout = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
    if rank == 0:
        fd = listener.detach() if listener is not None else None
        return dist.TCPStore(
            host,
            port,
            config.tp,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    return dist.TCPStore(host, port, config.tp, is_master=False, timeout=timeout)


def join_tp_group(
    config, rank: int, store: dist.TCPStore, device_type: str, check_peers: Callable[[], None] | None = None
) -> TPGroup:
    """Make this process rank `rank` of the TP group: meet the other ranks at the store, then
    create the device group and the control group. On rank 0, `check_peers` raises when a
    rank it started has died, instead of waiting for the rendezvous timeout."""
    layout = RankLayout.of(config)
    if device_type == "cuda":
        layout.check_gpus(torch.cuda.device_count())
    peer_all_reduce.disable_nvlink_multicast()  # before any communicator exists
    all_reduce_kind = peer_all_reduce.agreed_kind(store, rank, layout.nnodes)
    store.add("minfer/joined", 1)
    if rank == 0:
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
        while store.add("minfer/joined", 0) < config.tp:
            if check_peers is not None:
                check_peers()
            if time.monotonic() > deadline:
                raise TensorParallelError(
                    f"only {store.add('minfer/joined', 0)} of {config.tp} tensor-parallel "
                    f"ranks joined within {RENDEZVOUS_TIMEOUT_S} s"
                )
            time.sleep(0.02)
    local_rank = rank - layout.node_rank * layout.per_node
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    else:  # ranks of a node share its cores: N ranks each using every core would thrash
        set_cpu_threads(getattr(config, "cpu_threads", None), layout.per_node)
    # torch.distributed.nn.functional's collectives take `group=group.WORLD` as a default
    # argument, evaluated when the module is first imported. transformers imports it (config and
    # tokenizer loading, after this), so a first import inside a TP job captured this job's world
    # group for the life of the process: leave_tp_group could not free it, and the gloo group and
    # the store were destroyed at interpreter exit instead, which now and then aborted the
    # process ("terminate called without an active exception"). Imported before the group
    # exists, the defaults stay None.
    importlib.import_module("torch.distributed.nn.functional")

    previous_hook = sys.excepthook
    dist.init_process_group(
        "nccl" if device_type == "cuda" else "gloo", store=store, rank=rank, world_size=config.tp
    )
    if getattr(previous_hook, "__name__", "") == "_distributed_excepthook":
        # torch wraps sys.excepthook on every init to prefix "[rank0]: " to each traceback line;
        # after N TP jobs in one process every line carried the prefix N times. Keep one.
        sys.excepthook = previous_hook
    cpu_group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    peer = None
    if all_reduce_kind == "peer" and device_type == "cuda":  # on a CPU gloo stays
        peer = peer_all_reduce.PeerAllReduce(dist.group.WORLD, torch.device("cuda", local_rank))
    return TPGroup(rank, config.tp, dist.group.WORLD, cpu_group, local_rank, peer)


def leave_tp_group(tp: TPGroup) -> None:
    """Drop this process's groups, so that a later TP job in the same process can start.

    The caller first destroys every CUDA graph that captured a collective of the group: NCCL
    keeps such a communicator alive for the graphs, and both its destroy and its abort waited
    forever for them on the two-H200 host. NCCL communicators are then aborted, not destroyed
    (abort does not wait for peers, which may already be gone). Gloo groups are destroyed."""
    if not dist.is_initialized():
        return
    with contextlib.suppress(Exception):  # a peer already gone must not stop the cleanup
        if tp.cpu_group is not None:
            dist.destroy_process_group(tp.cpu_group)
        if dist.get_backend() == "nccl" and hasattr(dist.distributed_c10d, "_abort_process_group"):
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
