"""Triton attention backend for the GPU: paged decode (split-KV) and paged extend kernels.

Same contract as TorchAttentionBackend, which it is tested against: q holds the pass's tokens,
their K/V are already in the pool, and keys are found through the page table.
"""

from __future__ import annotations

import torch

from minfer.attention.base import ForwardContext
from minfer.kernels.attention_decode import decode_attention
from minfer.kernels.attention_extend import extend_attention


class TritonAttentionBackend:
    name = "triton"

    def forward(self, q: torch.Tensor, layer: int, ctx: ForwardContext, scale: float) -> torch.Tensor:
        """q: [T, Hq, D]. Returns [T, Hq, D].

        Decode launches depend only on static sizes (batch, heads, page-table width) and
        device tensors, so a decode step can be captured in a CUDA graph and replayed.
        """
        meta = ctx.attn
        pool = ctx.kv_pool
        k_pool, v_pool = pool.k[layer], pool.v[layer]
        # An fp8 pool's kernels widen K/V in registers and apply the layer's per-head scales.
        scales = pool.kernel_scales[layer]
        if meta.is_decode:
            return decode_attention(
                q, k_pool, v_pool, meta.page_table, meta.table_idx, meta.seq_lens, scale, **scales
            )
        return extend_attention(
            q,
            k_pool,
            v_pool,
            meta.page_table,
            meta.table_idx,
            meta.prefix_lens,
            meta.seq_lens,
            meta.cu_extend_lens,
            meta.max_extend_len,
            scale,
            **scales,
        )
