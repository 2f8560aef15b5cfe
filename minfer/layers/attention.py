"""The attention layer's read step: this pass's queries attend to keys found through the page table.

The K/V of the pass's own tokens reach the pool at the slots `ctx.out_loc` either before (the
model's torch layers and KVPool.store) or inside the backend's kernels (`new_kv`, when the
backend `writes_new_kv`).
"""

from __future__ import annotations

import torch
from torch import nn

from minfer.attention.base import ForwardContext, NewKV


class PagedAttention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, head_dim: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    def forward(self, q: torch.Tensor, ctx: ForwardContext, new_kv: NewKV | None = None) -> torch.Tensor:
        """q: [T, Hq, D]. Returns [T, Hq * D]."""
        o = ctx.backend.forward(q, self.layer_id, ctx, self.scale, new_kv)
        return o.reshape(q.shape[0], self.num_heads * self.head_dim)
