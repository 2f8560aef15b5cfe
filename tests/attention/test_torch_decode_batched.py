"""The torch backend's batched decode (one set of matmuls for the whole batch) against its
per-request loop, which the parity tests tie to transformers: over either pool layout, shuffled
slots, and a lone request's ascending run (read in place), with and without a sliding window."""

from __future__ import annotations

import pytest
import torch

from minfer.attention.base import ForwardContext, build_metadata
from minfer.attention.torch_backend import DecodePlan, TorchAttentionBackend
from minfer.kvcache.pool import KVPool


@pytest.mark.parametrize("head_major", [True, False])
@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize(
    "seq_lens, layout", [([1, 37, 5, 120, 64], "shuffled"), ([77], "shuffled"), ([77], "ascending")]
)
def test_batched_decode_matches_per_request_loop(seq_lens, layout, window, head_major):
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim, num_slots = 9, 3, 16, 400
    pool = KVPool(
        2, num_slots, num_kv_heads, head_dim, 1, torch.float32, torch.device("cpu"), head_major=head_major
    )
    for layer in range(2):
        pool.k[layer].normal_(generator=gen)
        pool.v[layer].normal_(generator=gen)
    if layout == "shuffled":
        # Rows of a shuffled slot order (as pages of finished requests come back), plus stale
        # entries past each sequence's end that the mask must hide.
        page_table = torch.stack([torch.randperm(num_slots, generator=gen)[:128] for _ in range(6)]).int()
    else:  # one ascending run per row, a lone stream's layout
        page_table = (torch.arange(6 * 128) + 3).remainder(num_slots).view(6, 128).int()
    table_idx = [4, 0, 2, 5, 1][: len(seq_lens)]
    meta = build_metadata(
        table_idx, [s - 1 for s in seq_lens], [1] * len(seq_lens), page_table, True, torch.device("cpu")
    )
    backend = TorchAttentionBackend()
    ctx = ForwardContext(attn=meta, kv_pool=pool, backend=backend, out_loc=torch.empty(0))
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    for layer in range(2):  # the second layer reuses the pass's plan
        batched = backend.forward(q, layer, ctx, head_dim**-0.5, window=window)
        looped = backend._per_request(q, layer, ctx, head_dim**-0.5, window=window)
        torch.testing.assert_close(batched, looped, rtol=1e-6, atol=1e-6)
    # The lone run is read in place (a view of the pool); anything else through the gather.
    assert (backend._plans[window].run is not None) == (layout == "ascending")


def test_run_detection_rejects_a_broken_run():
    page_table = torch.arange(300).view(1, 300).int()
    assert DecodePlan(build_metadata([0], [99], [1], page_table, True, torch.device("cpu"))).run == (0, 100)
    page_table[0, 50] = 299  # one slot out of order
    assert DecodePlan(build_metadata([0], [99], [1], page_table, True, torch.device("cpu"))).run is None
