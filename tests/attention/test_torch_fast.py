"""The --quantization models' faster torch prefill against the reference torch backend: with a
cached prefix, in chunks, over either pool layout. (Decode is the reference backend's own:
tests/attention/test_torch_decode_batched.py.)"""

from __future__ import annotations

import pytest
import torch

from minfer.attention.base import ForwardContext, build_metadata
from minfer.attention.torch_backend import TorchAttentionBackend
from minfer.attention.torch_fast import FastTorchAttentionBackend
from minfer.kvcache.pool import KVPool

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_SLOTS = 9, 3, 16, 600


def _pool(gen: torch.Generator, head_major: bool = True) -> KVPool:
    pool = KVPool(
        2, NUM_SLOTS, NUM_KV_HEADS, HEAD_DIM, 1, torch.float32, torch.device("cpu"), head_major=head_major
    )
    for layer in range(2):
        pool.k[layer].normal_(generator=gen)
        pool.v[layer].normal_(generator=gen)
    return pool


def _both(pool, page_table, table_idx, prefix_lens, extend_lens, is_decode, gen):
    meta = build_metadata(table_idx, prefix_lens, extend_lens, page_table, is_decode, torch.device("cpu"))
    q = torch.randn(sum(extend_lens), NUM_HEADS, HEAD_DIM, generator=gen)
    fast, reference = FastTorchAttentionBackend(), TorchAttentionBackend()
    for layer in range(2):  # the second layer reuses the pass's plan and buffers
        got = fast.forward(q, layer, ForwardContext(meta, pool, fast, torch.empty(0)), HEAD_DIM**-0.5)
        want = reference.forward(
            q, layer, ForwardContext(meta, pool, reference, torch.empty(0)), HEAD_DIM**-0.5
        )
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    return fast


@pytest.mark.parametrize("head_major", [True, False])
@pytest.mark.parametrize(
    "prefix_lens, extend_lens",
    # fresh, prefix hit, mixed chunks; long enough for several of SDPA's key and query blocks
    [([0], [57]), ([40], [23]), ([0, 31, 90, 5], [16, 16, 1, 64]), ([0, 300], [512, 212])],
)
def test_prefill_matches_reference(prefix_lens, extend_lens, head_major):
    gen = torch.Generator().manual_seed(1)
    page_table = torch.stack([torch.randperm(NUM_SLOTS, generator=gen)[:512] for _ in range(5)]).int()
    _both(
        _pool(gen, head_major),
        page_table,
        [3, 0, 4, 1][: len(prefix_lens)],
        prefix_lens,
        extend_lens,
        False,
        gen,
    )


def test_chunked_prefill_equals_one_pass():
    """Two chunks over the cache give the same output rows as one pass over the whole prompt."""
    gen = torch.Generator().manual_seed(2)
    pool = _pool(gen)
    page_table = torch.randperm(NUM_SLOTS, generator=gen)[:100].view(1, 100).int()
    q = torch.randn(70, NUM_HEADS, HEAD_DIM, generator=gen)
    backend = FastTorchAttentionBackend()

    def run(prefix, extend, rows):
        meta = build_metadata([0], [prefix], [extend], page_table, False, torch.device("cpu"))
        return backend.forward(rows, 0, ForwardContext(meta, pool, backend, torch.empty(0)), 0.25)

    whole = run(0, 70, q)
    chunked = torch.cat([run(0, 30, q[:30]), run(30, 40, q[30:])])
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
