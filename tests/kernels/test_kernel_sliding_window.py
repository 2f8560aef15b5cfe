"""Sliding-window attention (Mistral-7B-v0.1, Qwen2/Qwen3 with use_sliding_window): the query at
position i sees the keys at (i - window, i] only. The Triton decode and extend kernels and both
torch backends against the plain-torch reference, with windows shorter than, equal to and
longer than the sequences, across key blocks and splits, over a cached prefix and in chunks.
That the reference's window is transformers' is checked end to end in
tests/engine/test_sliding_window.py."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import make_paged_batch, tolerance

from minfer.attention.base import ForwardContext, build_metadata
from minfer.attention.torch_backend import TorchAttentionBackend
from minfer.attention.torch_fast import FastTorchAttentionBackend
from minfer.attention.triton_backend import TritonAttentionBackend
from minfer.kernels import attention_extend
from minfer.kernels.attention_decode import decode_attention
from minfer.kernels.attention_extend import extend_attention, extend_tiles
from minfer.kernels.attention_reference import decode_attention_reference, extend_attention_reference
from minfer.kvcache.pool import KVPool

NUM_KV_HEADS, GROUP, HEAD_DIM = 2, 2, 64
# Decode: sequences shorter than, as long as and longer than the window, one far longer.
DECODE_SEQ_LENS = [1, 19, 20, 21, 70, 130]
# Extend: fresh prompts, cached prefixes longer than the window, one-token and multi-block extends.
PREFIX_LENS, EXTEND_LENS = [0, 21, 40, 3, 50, 0], [19, 1, 35, 6, 40, 64]


def _batch(prefix_lens, extend_lens, page_size, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    batch = make_paged_batch(prefix_lens, extend_lens, NUM_KV_HEADS, HEAD_DIM, page_size, dtype, device, gen)
    q = torch.randn((sum(extend_lens), NUM_KV_HEADS * GROUP, HEAD_DIM), generator=gen).to(dtype).to(device)
    return batch, q


# (window, page size, dtype): windows of one key, shorter than, as long as and past the sequences
DECODE_CASES = [
    (1, 16, torch.float32),
    (7, 1, torch.bfloat16),
    (20, 16, torch.bfloat16),
    (64, 1, torch.float32),
]
EXTEND_CASES = [
    (1, 16, torch.bfloat16),
    (7, 1, torch.float32),
    (16, 16, torch.bfloat16),
    (37, 1, torch.bfloat16),
]


@pytest.mark.parametrize("window,page_size,dtype", DECODE_CASES)
def test_decode_kernel_window(window, page_size, dtype, device):
    batch, q = _batch([s - 1 for s in DECODE_SEQ_LENS], [1] * len(DECODE_SEQ_LENS), page_size, dtype, device)
    args = (q, batch.k_pool, batch.v_pool, batch.page_table, batch.table_idx, batch.seq_lens, HEAD_DIM**-0.5)
    expected = decode_attention_reference(*args, window=window)
    assert not torch.allclose(expected, decode_attention_reference(*args), **tolerance(dtype))
    for num_splits in (None, 3, 8):  # more splits than the window has key blocks, too
        out = decode_attention(*args, num_splits=num_splits, window=window)
        torch.testing.assert_close(out, expected, **tolerance(dtype))


@pytest.mark.parametrize("window,page_size,dtype", EXTEND_CASES)
def test_extend_kernel_window(window, page_size, dtype, device):
    batch, q = _batch(PREFIX_LENS, EXTEND_LENS, page_size, dtype, device, seed=1)
    scale = HEAD_DIM**-0.5
    common = (batch.page_table, batch.table_idx, batch.prefix_lens, batch.seq_lens)
    expected = extend_attention_reference(q, batch.k_pool, batch.v_pool, *common, scale, window=window)
    longest = max(EXTEND_LENS)
    block_m = attention_extend.launch_config(longest, q.is_cuda)[0]
    tiles = torch.tensor(extend_tiles(EXTEND_LENS, block_m), dtype=torch.int32, device=device)
    for tile_map in (tiles, None):  # as the engine launches it, and the grid without a map
        out = extend_attention(
            q,
            batch.k_pool,
            batch.v_pool,
            *common,
            batch.cu_extend_lens,
            longest,
            scale,
            tiles=tile_map,
            window=window,
        )
        torch.testing.assert_close(out, expected, **tolerance(dtype))


def _context(batch, is_decode, backend, dtype, device) -> ForwardContext:
    meta = build_metadata(
        batch.table_idx_cpu, batch.prefix_lens_cpu, batch.extend_lens_cpu, batch.page_table, is_decode, device
    )
    pool = KVPool(1, batch.k_pool.shape[0] - 1, NUM_KV_HEADS, HEAD_DIM, 1, dtype, device)
    pool.k[0], pool.v[0] = batch.k_pool, batch.v_pool
    return ForwardContext(attn=meta, kv_pool=pool, backend=backend, out_loc=torch.empty(0))


@pytest.mark.parametrize(
    "backend_type", [TorchAttentionBackend, FastTorchAttentionBackend, TritonAttentionBackend]
)
@pytest.mark.parametrize("is_decode", [True, False])
def test_backends_window(backend_type, is_decode, device):
    """Each backend applies the window it is given, and keeps a layer without one unchanged
    within the same pass (Qwen2's use_sliding_window mixes both kinds of layer)."""
    if backend_type is not TritonAttentionBackend and device.type != "cpu":
        pytest.skip("the torch backends are checked on the CPU")
    dtype, window, scale = torch.float32, 13, HEAD_DIM**-0.5
    if is_decode:
        batch, q = _batch([s - 1 for s in DECODE_SEQ_LENS], [1] * len(DECODE_SEQ_LENS), 16, dtype, device)
        reference = lambda w: decode_attention_reference(  # noqa: E731
            q, batch.k_pool, batch.v_pool, batch.page_table, batch.table_idx, batch.seq_lens, scale, window=w
        )
    else:
        batch, q = _batch(PREFIX_LENS, EXTEND_LENS, 16, dtype, device, seed=2)
        reference = lambda w: extend_attention_reference(  # noqa: E731
            q,
            batch.k_pool,
            batch.v_pool,
            batch.page_table,
            batch.table_idx,
            batch.prefix_lens,
            batch.seq_lens,
            scale,
            window=w,
        )
    backend = backend_type()
    ctx = _context(batch, is_decode, backend, dtype, device)
    for w in (window, None, window):  # the pass's plan per window, shared by later layers
        out = backend.forward(q, 0, ctx, scale, window=w)
        torch.testing.assert_close(out, reference(w), **tolerance(dtype))


@pytest.mark.parametrize("head_major", [True, False])
def test_torch_backend_lone_run_reads_only_the_window(head_major):
    """A lone request on one ascending run of slots decodes over a view of the pool: with a
    window, over the run's last `window` slots."""
    dtype, device, window = torch.float32, torch.device("cpu"), 24
    gen = torch.Generator().manual_seed(4)
    pool = KVPool(1, 300, NUM_KV_HEADS, HEAD_DIM, 1, dtype, device, head_major=head_major)
    pool.k[0].normal_(generator=gen)
    pool.v[0].normal_(generator=gen)
    page_table = torch.arange(256, dtype=torch.int32).view(1, 256) + 7
    meta = build_metadata([0], [99], [1], page_table, True, device)
    q = torch.randn(1, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=gen)
    backend = FastTorchAttentionBackend()
    out = backend.forward(q, 0, ForwardContext(meta, pool, backend, torch.empty(0)), 0.125, window=window)
    assert backend.decode_plan(meta, window).run == (7 + 100 - window, window)
    expected = decode_attention_reference(
        q, pool.k[0], pool.v[0], page_table, meta.table_idx, meta.seq_lens, 0.125, window=window
    )
    torch.testing.assert_close(out, expected, **tolerance(dtype))
