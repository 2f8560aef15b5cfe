"""The attention layer: store this pass's K/V in the pool, then let the backend read."""

from __future__ import annotations

import torch
from torch import nn

from minfer.attention.base import ForwardContext


class PagedAttention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D]. Returns [T, Hq * D]."""
        ctx.kv_pool.store(self.layer_id, k, v, ctx.out_loc)  # write
        o = ctx.backend.forward(q, self.layer_id, ctx, self.scale)  # read
        return o.reshape(q.shape[0], self.num_heads * self.head_dim)
