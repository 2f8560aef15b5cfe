"""Triton attention backend for the GPU: paged decode (split-KV) and paged extend kernels.

Same contract as TorchAttentionBackend, which it is tested against: q holds the pass's tokens
and keys are found through the page table. It also takes the pass's K/V unfinished (`NewKV`):
a decode batch of up to DECODE_PROLOGUE_MAX_BATCH rows finishes them inside the decode kernel,
anything else runs the rope_store kernel first.
"""

from __future__ import annotations

import os

import torch

from minfer.attention.base import ForwardContext
from minfer.device import to_device
from minfer.kernels.attention_decode import decode_attention
from minfer.kernels.attention_extend import extend_attention, extend_tiles, launch_config
from minfer.kernels.new_kv import NewKV
from minfer.kernels.rope_store import store_new_kv

# Doing rope_store's work in the decode kernel's prologue saves a launch per layer (~3 us in a
# CUDA graph on an H200) but every split program then normalises and rotates its q group
# again, which costs more than the launch once the batch alone fills the GPU: measured on
# Qwen3-0.6B, batch 1 1.47 -> 1.38 ms per step, 16-31 running 2.52 -> 2.46, 128-256 running
# 6.09 -> 6.15 (docs/PERFORMANCE.md). The environment variable is for A/B measurements.
DECODE_PROLOGUE_MAX_BATCH = int(os.environ.get("MINFER_DECODE_PROLOGUE_MAX_BATCH", "32"))


class TritonAttentionBackend:
    name = "triton"
    writes_new_kv = True

    def forward(
        self,
        q: torch.Tensor,
        layer: int,
        ctx: ForwardContext,
        scale: float,
        new_kv: NewKV | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D]. Returns [T, Hq, D].

        Decode launches depend only on static sizes (batch, heads, page-table width) and
        device tensors, so a decode step can be captured in a CUDA graph and replayed.
        """
        meta = ctx.attn
        pool = ctx.kv_pool
        assert not pool.head_major, "the Triton kernels index a slot-major pool"
        k_pool, v_pool = pool.k[layer], pool.v[layer]
        # An fp8 pool's kernels widen K/V in registers and apply the layer's per-head scales.
        scales = pool.kernel_scales[layer]
        fused = meta.is_decode and q.shape[0] <= DECODE_PROLOGUE_MAX_BATCH  # static per CUDA graph
        if new_kv is not None and not fused:
            store_new_kv(q, new_kv, pool, layer)
            new_kv = None
        if meta.is_decode:
            return decode_attention(
                q,
                k_pool,
                v_pool,
                meta.page_table,
                meta.table_idx,
                meta.seq_lens,
                scale,
                **scales,
                new_kv=new_kv,
                window=window,
            )
        if meta.extend_tiles is None:
            block_m = launch_config(meta.max_extend_len, q.is_cuda, pool.quantized)[0]
            tiles = extend_tiles(meta.extend_lens_cpu, block_m)
            meta.extend_tiles = to_device(tiles, torch.int32, q.device)
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
            tiles=meta.extend_tiles,
            window=window,
        )
