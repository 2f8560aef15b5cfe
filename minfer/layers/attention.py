"""The attention layer's read step: this pass's queries attend to keys found through the page table.

The pass's own K/V must be in the pool before its keys are read. On the CPU the model writes
them first (KVPool.store, at the slots `ctx.out_loc`). On CUDA it hands them over unfinished
(`NewKV`: RoPE, Qwen3's q/k norms and the write still to do): a backend that `writes_new_kv`
does that inside its own kernels (the Triton decode kernel, in its prologue); for any other,
this layer runs the fused rope_store kernel first.
"""

from __future__ import annotations

import torch
from torch import nn

from minfer.attention.base import ForwardContext
from minfer.kernels.new_kv import NewKV
from minfer.kernels.rope_store import store_new_kv


class PagedAttention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, head_dim: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def forward(self, q: torch.Tensor, ctx: ForwardContext, new_kv: NewKV | None = None) -> torch.Tensor:
        """q: [T, Hq, D]. Returns [T, Hq * D]."""
        if new_kv is not None and not ctx.backend.writes_new_kv:
            store_new_kv(q, new_kv, ctx.kv_pool, self.layer_id)
            new_kv = None
        o = ctx.backend.forward(q, self.layer_id, ctx, self.scale, new_kv)
        return o.reshape(q.shape[0], self.num_heads * self.head_dim)
