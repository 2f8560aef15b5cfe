"""The decode kernel's prologue (rope_store's work done inside decode attention) against the two
launches it replaces: rope_store, then decode attention over the finished q and the stored K/V.

Both run the same Triton helpers in the same order, so the attention outputs and the pools must
agree exactly, whichever split holds the new position, with Qwen3's q/k norms or without, and
for an fp8 pool (which quantizes the new k and v on the way in) -- except float32 on a GPU, where
the compiler fuses the norm's multiply-adds differently in the two kernels (seen on an H200: up
to 5e-7 apart, a few float32 ulps), so there they must agree to float32 rounding.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import make_paged_batch

from minfer.attention.base import ForwardContext, build_metadata
from minfer.attention.triton_backend import TritonAttentionBackend
from minfer.kernels.attention_decode import decode_attention
from minfer.kernels.new_kv import NewKV
from minfer.kernels.rope_store import rope_store
from minfer.kvcache.pool import KVPool
from minfer.layers.rotary import RotaryEmbedding

NUM_KV_HEADS, GROUP, HEAD_DIM = 2, 2, 64


def _case(dtype, device, seq_lens, qk_norm, seed=3):
    gen = torch.Generator().manual_seed(seed)
    batch = make_paged_batch(
        [s - 1 for s in seq_lens], [1] * len(seq_lens), NUM_KV_HEADS, HEAD_DIM, 4, dtype, device, gen
    )
    heads = NUM_KV_HEADS * GROUP
    # q, k, v as the model hands them over: strided views into one fused qkv output
    qkv = (
        torch.randn((len(seq_lens), (heads + 2 * NUM_KV_HEADS) * HEAD_DIM), generator=gen)
        .to(dtype)
        .to(device)
    )
    q, k, v = qkv.split([heads * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], dim=-1)
    q, k, v = (t.view(len(seq_lens), -1, HEAD_DIM) for t in (q, k, v))
    rotary = RotaryEmbedding(HEAD_DIM, 512, {"rope_theta": 10_000.0, "rope_type": "default"})
    positions = batch.seq_lens.long() - 1
    rows = batch.page_table[batch.table_idx.long()]
    out_loc = rows.gather(1, positions[:, None]).squeeze(1)  # the new token's slot
    norms = ()
    if qk_norm:
        weights = (1 + torch.randn((2, HEAD_DIM), generator=gen) / 4).to(dtype).to(device)
        norms = (weights[0], weights[1], 1e-6)
    new_kv = NewKV(k, v, positions, rotary.cos_sin.to(dtype).to(device), out_loc, *norms)
    return batch, q, new_kv


def _same_rounding(dtype, device) -> dict:
    """assert_close tolerances for "the same arithmetic": exact, but float32 on CUDA to its rounding."""
    if dtype == torch.float32 and device.type == "cuda":
        return dict(atol=1e-5, rtol=1.3e-6)
    return dict(atol=0, rtol=0)


def _fp8_pools(batch):
    device = batch.k_pool.device
    scales = torch.tensor([0.5, 2.0], device=device), torch.tensor([1.5, 0.25], device=device)
    pools = [
        (p.float() / s[None, :, None]).to(torch.float8_e4m3fn)
        for p, s in zip((batch.k_pool, batch.v_pool), scales)
    ]
    return pools, {"k_scale": scales[0], "v_scale": scales[1]}


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits,window", [(1, None), (3, None), (8, None), (3, 20), (8, 20)])
def test_prologue_equals_rope_store_then_attention(dtype, qk_norm, num_splits, window, device):
    """With a sliding window the splits share only the window's keys, and one of them still
    holds the new position and writes it."""
    batch, q, new_kv = _case(dtype, device, [1, 9, 30, 61], qk_norm)
    k_two, v_two = batch.k_pool.clone(), batch.v_pool.clone()
    q_two = q.clone()
    norms = new_kv[5:] if qk_norm else ()
    rope_store(
        q_two, new_kv.k, new_kv.v, new_kv.positions, new_kv.cos_sin, k_two, v_two, new_kv.out_loc, *norms
    )
    args = (batch.page_table, batch.table_idx, batch.seq_lens, HEAD_DIM**-0.5)
    expected = decode_attention(q_two, k_two, v_two, *args, num_splits=num_splits, window=window)

    q_before = q.clone()
    out = decode_attention(
        q, batch.k_pool, batch.v_pool, *args, num_splits=num_splits, new_kv=new_kv, window=window
    )
    same = _same_rounding(dtype, q.device)
    torch.testing.assert_close(out, expected, **same)
    torch.testing.assert_close(batch.k_pool, k_two, **same)  # the new k, rotated, in its slot
    torch.testing.assert_close(batch.v_pool, v_two, **same)
    assert torch.equal(q, q_before), "the prologue finishes q in registers and leaves the input alone"


def test_prologue_with_an_fp8_pool(device):
    batch, q, new_kv = _case(torch.bfloat16, device, [5, 40], qk_norm=True)
    (k_pool, v_pool), scales = _fp8_pools(batch)
    k_two, v_two, q_two = k_pool.clone(), v_pool.clone(), q.clone()
    rope_store(
        q_two,
        new_kv.k,
        new_kv.v,
        new_kv.positions,
        new_kv.cos_sin,
        k_two,
        v_two,
        new_kv.out_loc,
        *new_kv[5:],
        **scales,
    )
    args = (batch.page_table, batch.table_idx, batch.seq_lens, HEAD_DIM**-0.5)
    expected = decode_attention(q_two, k_two, v_two, *args, num_splits=3, **scales)
    out = decode_attention(q, k_pool, v_pool, *args, num_splits=3, **scales, new_kv=new_kv)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    assert torch.equal(k_pool.view(torch.uint8), k_two.view(torch.uint8))
    assert torch.equal(v_pool.view(torch.uint8), v_two.view(torch.uint8))


@pytest.mark.parametrize("batch_size", [2, 40])  # below and above DECODE_PROLOGUE_MAX_BATCH
def test_backend_finishes_new_kv_at_any_batch_size(batch_size, device, monkeypatch):
    """The backend takes NewKV at every batch size: small decode batches through the prologue,
    larger ones through rope_store first; both leave the same pool and output."""
    import minfer.attention.triton_backend as backend_module

    seq_lens = [3 + 7 * i % 50 for i in range(batch_size)]
    batch, q, new_kv = _case(torch.float32, device, seq_lens, qk_norm=True)  # (GPU pools: unseeded)
    meta = build_metadata(
        batch.table_idx_cpu, [s - 1 for s in seq_lens], [1] * batch_size, batch.page_table, True, device
    )
    results = []
    for limit in (0, 64):  # rope_store first / the prologue
        monkeypatch.setattr(backend_module, "DECODE_PROLOGUE_MAX_BATCH", limit)
        pool = KVPool(1, batch.k_pool.shape[0] - 1, NUM_KV_HEADS, HEAD_DIM, 1, torch.float32, device)
        pool.k[0].copy_(batch.k_pool)
        pool.v[0].copy_(batch.v_pool)
        ctx = ForwardContext(meta, pool, TritonAttentionBackend(), new_kv.out_loc)
        out = TritonAttentionBackend().forward(q.clone(), 0, ctx, HEAD_DIM**-0.5, new_kv)
        results.append((out, pool.k[0].clone(), pool.v[0].clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **_same_rounding(torch.float32, a.device))
