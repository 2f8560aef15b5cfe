"""The attention layer's read step: this pass's queries attend to keys found through the page table.

The K/V of the pass's own tokens are already in the pool when it runs: the model writes them
first (KVPool.store, or the fused rope_store kernel on CUDA) at the slots `ctx.out_loc`.
"""

from __future__ import annotations

import torch
from torch import nn

from minfer.attention.base import ForwardContext


class PagedAttention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, head_dim: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def forward(self, q: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """q: [T, Hq, D]. Returns [T, Hq * D]."""
        o = ctx.backend.forward(q, self.layer_id, ctx, self.scale)
        return o.reshape(q.shape[0], self.num_heads * self.head_dim)
