"""What every attention backend receives: the forward context of one pass.

The context is built once per forward pass by the engine and handed down through the model
explicitly (no module globals). It says where new K/V go (`out_loc`, the write step) and how
to find each request's earlier K/V (page table rows and lengths, the read step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from minfer.device import to_device
from minfer.kernels.new_kv import NewKV
from minfer.kvcache.pool import KVPool


@dataclass
class AttentionMetadata:
    """Per-request geometry of one pass, on the device and (for loops and launch sizes) the CPU.

    For request i, the pass computes queries for positions [prefix_lens[i], seq_lens[i]);
    they attend causally to keys [0, seq_lens[i]) found through page_table[table_idx[i]].
    """

    is_decode: bool
    table_idx: torch.Tensor  # [B] int32
    prefix_lens: torch.Tensor  # [B] int32: cached_len before the pass
    seq_lens: torch.Tensor  # [B] int32: cached_len after the pass
    cu_extend_lens: torch.Tensor  # [B + 1] int32: query offsets into the flattened tokens
    page_table: torch.Tensor  # [rows, max_len] int32 slots
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    max_extend_len: int
    # The Triton extend kernel's tile map (kernels/attention_extend.py `extend_tiles`), made by
    # the backend on a pass's first layer and reused by the others; a prefill CUDA graph
    # brings its own fixed-size one.
    extend_tiles: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_cpu)


@dataclass
class ForwardContext:
    attn: AttentionMetadata
    kv_pool: KVPool
    backend: AttentionBackend
    out_loc: torch.Tensor  # [num_tokens] slots for this pass's K/V


class AttentionBackend(Protocol):
    name: str
    # True: the backend accepts a pass's K/V unfinished (`NewKV`: RoPE, norms and the pool write
    # still to do) and does that work inside its own kernels. False: it expects them stored.
    writes_new_kv: bool

    def forward(
        self,
        q: torch.Tensor,
        layer: int,
        ctx: ForwardContext,
        scale: float,
        new_kv: NewKV | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D] of the pass's tokens. Returns [T, Hq, D]. Without `new_kv` the pass's
        K/V are already in the pool and q is final. With a `window`, the query at position i
        sees the keys at (i - window, i] only (layers/attention.py)."""


def build_metadata(
    table_idx: list[int],
    prefix_lens: list[int],
    extend_lens: list[int],
    page_table: torch.Tensor,
    is_decode: bool,
    device: torch.device,
) -> AttentionMetadata:
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    cu = [0]
    for e in extend_lens:
        cu.append(cu[-1] + e)
    packed = to_device([table_idx, prefix_lens, seq_lens], torch.int32, device)
    return AttentionMetadata(
        is_decode=is_decode,
        table_idx=packed[0],
        prefix_lens=packed[1],
        seq_lens=packed[2],
        cu_extend_lens=to_device(cu, torch.int32, device),
        page_table=page_table,
        prefix_lens_cpu=prefix_lens,
        extend_lens_cpu=extend_lens,
        max_extend_len=max(extend_lens),
    )
