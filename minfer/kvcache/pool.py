"""The KV pool: one K and one V tensor per layer, indexed by physical slot."""

from __future__ import annotations

import torch


class KVPool:
    """Per-layer K/V storage of shape [num_slots + page_size, num_kv_heads, head_dim].

    The last page (slots num_slots .. num_slots + page_size - 1) is never handed out: padded
    rows of a CUDA-graph batch write their K/V there, so they cannot corrupt a real request.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scratch_slot = num_slots
        shape = (num_slots + page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor) -> None:
        """Write step of the KV life cycle: new K/V of this pass go to their allocated slots.
        (On CUDA the model writes through the fused minfer/kernels/rope_store.py instead.)"""
        self.k[layer].index_copy_(0, out_loc, k)
        self.v[layer].index_copy_(0, out_loc, v)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Read step for the torch backend: K and V at `slots` ([S] int64), each [S, Hk, D], in
        the dtype attention computes with. Every torch-side read of the pool goes through here,
        so a change of storage format (a low-bit cache) has one place to decode."""
        # index_select, not k[slots]: advanced indexing on CPU goes through a parallel kernel
        # whose thread wake-up costs milliseconds on a busy machine.
        return self.k[layer].index_select(0, slots), self.v[layer].index_select(0, slots)
