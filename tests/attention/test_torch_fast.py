"""The --quantization models' faster torch path against the reference torch backend: prefill with
a cached prefix and in chunks, decode over shuffled slots, one ascending run, mixed lengths."""

from __future__ import annotations

import pytest
import torch

from minfer.attention.base import ForwardContext, build_metadata
from minfer.attention.torch_backend import TorchAttentionBackend
from minfer.attention.torch_fast import FastDecodePlan, FastTorchAttentionBackend
from minfer.kvcache.pool import KVPool

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_SLOTS = 9, 3, 16, 600


def _pool(gen: torch.Generator) -> KVPool:
    pool = KVPool(2, NUM_SLOTS, NUM_KV_HEADS, HEAD_DIM, 1, torch.float32, torch.device("cpu"))
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


@pytest.mark.parametrize(
    "prefix_lens, extend_lens",
    [([0], [57]), ([40], [23]), ([0, 31, 90, 5], [16, 16, 1, 64])],  # fresh, prefix hit, mixed chunks
)
def test_prefill_matches_reference(prefix_lens, extend_lens):
    gen = torch.Generator().manual_seed(1)
    page_table = torch.stack([torch.randperm(NUM_SLOTS, generator=gen)[:200] for _ in range(5)]).int()
    _both(_pool(gen), page_table, [3, 0, 4, 1][: len(prefix_lens)], prefix_lens, extend_lens, False, gen)


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


@pytest.mark.parametrize("seq_lens", [[1, 37, 5, 120, 64], [77], [200]])
@pytest.mark.parametrize("layout", ["shuffled", "ascending"])
def test_decode_matches_reference(seq_lens, layout):
    gen = torch.Generator().manual_seed(0)
    if layout == "shuffled":  # as pages of finished requests come back
        page_table = torch.stack([torch.randperm(NUM_SLOTS, generator=gen)[:256] for _ in range(6)]).int()
    else:  # one ascending run per row, a lone stream's layout
        page_table = torch.arange(6 * 256).remainder(NUM_SLOTS).view(6, 256).int()
    table_idx = [1, 0, 2, 5, 1][: len(seq_lens)] if len(seq_lens) > 1 else [1]
    prefix = [s - 1 for s in seq_lens]
    fast = _both(_pool(gen), page_table, table_idx, prefix, [1] * len(seq_lens), True, gen)
    # A lone request on one ascending run is read in place; anything else goes through the gather.
    assert (fast._plans[None].runs is not None) == (layout == "ascending" and len(seq_lens) == 1)


def test_decode_run_detection_rejects_a_broken_run():
    page_table = torch.arange(300).view(1, 300).int()
    page_table[0, 50] = 299  # one slot out of order
    meta = build_metadata([0], [99], [1], page_table, True, torch.device("cpu"))
    assert FastDecodePlan(meta).runs is None
