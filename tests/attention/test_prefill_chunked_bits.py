"""The torch backend's prefill (query rows in blocks on one thread, the mask by column ranges,
keys scored only where a block sees them) against the eager formula it replaced, written out
here: equal bit for bit (torch.equal), for float32 and bfloat16, with and without a cached
prefix and a sliding window, grouped and plain heads, at extends around the block bounds."""

from __future__ import annotations

import pytest
import torch

from minfer.attention.base import ForwardContext, build_metadata
from minfer.attention.torch_backend import TorchAttentionBackend
from minfer.kvcache.pool import KVPool

HEAD_DIM, KV_HEADS = 64, 3
ROWS = TorchAttentionBackend.ROWS
# Extends of one block, just under / at / over one and several block bounds, and long ones.
EXTENDS = [1, 2, 3, 5, 63, 64, 65, ROWS - 1, ROWS, ROWS + 1, 2 * ROWS + 1, 300, 5 * ROWS - 3, 1000]


def eager(q, k, v, scale, prefix, window, group):
    """transformers' eager attention, as the backend computed it before blocks: q [E, Hq, D],
    k/v [Hk, S, D]."""
    extend, seq = q.shape[0], k.shape[1]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    scores = torch.matmul(q.transpose(0, 1).float(), k.float().transpose(1, 2)) * scale
    visible = torch.ones(extend, seq, dtype=torch.bool).tril(diagonal=prefix)
    if window is not None:
        visible = visible.triu(diagonal=prefix - window + 1)
    if extend > 1 or (window is not None and seq > window):
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v.float()).to(q.dtype).transpose(0, 1)


def run_backend(q, requests, dtype, gen):
    """The backend's prefill of `requests` [(prefix, extend)] in one pass, their K/V on
    scattered slots of a head-major pool; returns its output and each request's (k, v)."""
    seqs = [p + e for p, e in requests]
    num_slots = sum(seqs) + 7
    pool = KVPool(1, num_slots, KV_HEADS, HEAD_DIM, 1, dtype, torch.device("cpu"), head_major=True)
    pool.storage.copy_(torch.randn(pool.storage.shape, generator=gen).to(dtype))
    order = torch.randperm(num_slots, generator=gen)
    page_table = torch.zeros(len(requests), max(seqs), dtype=torch.int32)
    taken = 0
    for i, seq in enumerate(seqs):
        page_table[i, :seq] = order[taken : taken + seq]
        taken += seq
    prefixes, extends = [p for p, _ in requests], [e for _, e in requests]
    meta = build_metadata(
        list(range(len(requests))), prefixes, extends, page_table, False, torch.device("cpu")
    )
    backend = TorchAttentionBackend()
    ctx = ForwardContext(attn=meta, kv_pool=pool, backend=backend, out_loc=torch.empty(0))
    kv = [pool.gather_heads(0, page_table[i, :seq].long()) for i, seq in enumerate(seqs)]
    return backend, ctx, kv


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window", [None, 1, 50, 200])
@pytest.mark.parametrize("prefix", [0, 17, 700])
def test_prefill_equals_eager_bit_for_bit(prefix, window, group, dtype, threads):
    gen = torch.Generator().manual_seed(prefix * 7 + (window or 0) + group)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # blocks on one thread; one block per request with more
    try:
        for extend in EXTENDS:
            # A request of this extend, and a short one after it in the same pass.
            requests = [(prefix, extend), (5, 3)]
            q = torch.randn(extend + 3, KV_HEADS * group, HEAD_DIM, generator=gen).to(dtype)
            backend, ctx, kv = run_backend(q, requests, dtype, gen)
            got = backend.forward(q, 0, ctx, HEAD_DIM**-0.5, window=window)
            start = 0
            for (p, e), (k, v) in zip(requests, kv):
                want = eager(q[start : start + e], k, v, HEAD_DIM**-0.5, p, window, group)
                assert torch.equal(got[start : start + e], want), (extend, p)
                start += e
    finally:
        torch.set_num_threads(before)
