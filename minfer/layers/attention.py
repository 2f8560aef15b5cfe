"""The attention layer's read step: this pass's queries attend to keys found through the page table.

The pass's own K/V must be in the pool before its keys are read. On the CPU the model writes
them first (KVPool.store, at the slots `ctx.out_loc`). On CUDA it hands them over unfinished
(`NewKV`: RoPE, Qwen3's q/k norms and the write still to do): a backend that `writes_new_kv`
does that inside its own kernels (the Triton decode kernel, in its prologue); for any other,
this layer runs the fused rope_store kernel first.

A layer may attend over a sliding window (Mistral-7B-v0.1, Qwen2/Qwen3 with use_sliding_window):
its query at position i sees only the keys at (i - window, i], as transformers masks them. Every
backend applies the window; the pool still keeps the older keys (the prefix cache shares them).
"""

from __future__ import annotations

import torch
from torch import nn

from minfer.attention.base import ForwardContext
from minfer.kernels.new_kv import NewKV
from minfer.kernels.rope_store import store_new_kv
from minfer.layers.rotary import context_length


def sliding_window_of(hf_config, layer_id: int) -> int | None:
    """How many of the latest keys (its own included) a query of this layer sees; None: all.

    transformers' rule: `sliding_window` applies on the layers that `layer_types` marks
    "sliding_attention" (Qwen2, Qwen3: set only with use_sliding_window), or on every layer of a
    config without layer_types (Mistral, Mixtral). A window as long as the context never binds."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or window >= context_length(hf_config):
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and layer_types[layer_id] != "sliding_attention":
        return None
    return int(window)


class PagedAttention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, head_dim: int, sliding_window: int | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window

    def forward(self, q: torch.Tensor, ctx: ForwardContext, new_kv: NewKV | None = None) -> torch.Tensor:
        """q: [T, Hq, D]. Returns [T, Hq * D]."""
        if new_kv is not None and not ctx.backend.writes_new_kv:
            store_new_kv(q, new_kv, ctx.kv_pool, self.layer_id)
            new_kv = None
        o = ctx.backend.forward(q, self.layer_id, ctx, self.scale, new_kv, window=self.sliding_window)
        return o.reshape(q.shape[0], self.num_heads * self.head_dim)
