"""A prefill CUDA graph's metadata (engine/prefill_graph.py): one fixed-size buffer per token
bucket holds the pass's requests, a padding request and the extend kernel's tile map. The
capture itself needs a GPU (tests/engine/test_prefill_graphs_gpu.py); the layout, and the
extend kernel run through it, are checked here (on the CPU in Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import make_paged_batch, tolerance

from minfer.attention.base import ForwardContext
from minfer.attention.triton_backend import TritonAttentionBackend
from minfer.engine.prefill_graph import metadata_views, pass_metadata, prefill_buckets
from minfer.kernels.attention_extend import LONG_EXTEND, launch_config
from minfer.kernels.attention_reference import extend_attention_reference
from minfer.kvcache.pool import KVPool


def test_buckets_are_at_most_an_eighth_apart():
    buckets = prefill_buckets(8192)
    assert buckets[0] == 64 and buckets[-1] == 8192 and len(buckets) == 40
    assert all(b % 64 == 0 and 8 * (b - a) <= max(a, 512) for a, b in zip(buckets, buckets[1:]))
    assert prefill_buckets(100) == [64, 100] and prefill_buckets(64) == [64]


def test_a_pass_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="exceed the bucket"):
        pass_metadata(64, 16, 32, 16, 9, [0], [0], [65])
    with pytest.raises(ValueError, match="exceed the bucket"):
        pass_metadata(64, 16, 32, 16, 9, list(range(15)), [0] * 15, [1] * 15)


@pytest.mark.parametrize("page_size", [1, 16])
def test_attention_through_a_padded_graph_buffer(page_size, device):
    """Real requests (one with a cached prefix) padded to a 128-token bucket: their rows equal
    the reference; the padding request's rows are finite (they attend to the scratch slot)."""
    dtype, num_kv_heads, head_dim, group = torch.float32, 2, 32, 2
    prefix, extend = [0, 30, 0], [23, 17, 40]
    gen = torch.Generator().manual_seed(3)
    batch = make_paged_batch(prefix, extend, num_kv_heads, head_dim, page_size, dtype, device, gen, 160)
    padding_row = next(r for r in range(batch.page_table.shape[0]) if r not in batch.table_idx_cpu)
    batch.page_table[padding_row] = 0  # every position of the padding row at one slot
    tokens, width, block_m = 128, 16, launch_config(LONG_EXTEND - 1, device.type == "cuda")[0]
    tile_width = -(-(-(-tokens // block_m) + width) // 16) * 16
    host = pass_metadata(tokens, width, tile_width, block_m, padding_row, batch.table_idx_cpu, prefix, extend)
    assert len(host) == 4 * width + 2 * tile_width
    buf = torch.tensor(host, dtype=torch.int32, device=device)
    meta = metadata_views(buf, width, tokens, batch.page_table)
    cu = meta.cu_extend_lens.tolist()
    assert cu[:5] == [0, 23, 40, 80, 128] and set(cu[5:]) == {128}
    assert meta.seq_lens.tolist()[:4] == [23, 47, 40, 48]
    pool = KVPool(1, batch.k_pool.shape[0] - 1, num_kv_heads, head_dim, 1, dtype, device)
    pool.k[0], pool.v[0] = batch.k_pool, batch.v_pool
    ctx = ForwardContext(meta, pool, TritonAttentionBackend(), torch.empty(0))
    q = torch.randn((tokens, num_kv_heads * group, head_dim), generator=gen).to(device)
    out = TritonAttentionBackend().forward(q, 0, ctx, head_dim**-0.5)
    real = sum(extend)
    expected = extend_attention_reference(
        q[:real], batch.k_pool, batch.v_pool, batch.page_table, batch.table_idx, batch.prefix_lens,
        batch.seq_lens, head_dim**-0.5,
    )  # fmt: skip
    torch.testing.assert_close(out[:real], expected, **tolerance(dtype))
    assert torch.isfinite(out[real:]).all()
