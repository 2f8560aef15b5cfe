"""Everything between the qkv projection and attention, in one Triton kernel per layer:

    q, k  <- RMSNorm per head (Qwen3's q_norm / k_norm; skipped for models without it)
    q, k  <- RoPE ("rotate half" layout)
    k_pool[out_loc], v_pool[out_loc] <- k, v        (the write step of the KV life cycle)

q is rotated in place (it stays in the qkv projection's output, where attention reads it); k
and v go straight to their pool slots and are not written back. Done as separate kernels this
was four launches per layer (two norms over per-head rows, RoPE, KV store), each a few
microseconds even at batch 1, plus three extra round trips of q and k through memory.

One program handles one token: all its query heads, then all its key/value heads. Rounding
follows the torch layers step by step (minfer/layers/norm.py, minfer/layers/rotary.py), so the
outputs are those of RMSNorm -> RotaryEmbedding -> KVPool.store: the normalised value is rounded
to the activation dtype before the weight multiplies it, the weighted result is rounded again
(that is what the unfused path stored), cos and sin are rounded to the activation dtype, and
each RoPE product and the sum are rounded as the separate torch ops round them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minfer.kernels.common import to_fp8


@triton.jit
def _norm_rope_heads(
    x_ptr,
    token,
    stride_t,
    stride_h,
    weight_ptr,
    eps,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """The [heads, head_dim] rows of one token, normalised and rotated, as two halves."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)
    first = x_ptr + token * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    dtype = x_ptr.dtype.element_ty
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
        w1 = tl.load(weight_ptr + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(weight_ptr + HALF + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = ((x1 * rstd[:, None]).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd[:, None]).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    out1 = ((x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)).to(dtype)
    return out1, out2, offs_h, offs_d, mask


@triton.jit
def _rope_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    positions_ptr,
    cos_sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    k_pool_ptr,
    v_pool_ptr,
    out_loc_ptr,
    k_scale_ptr,
    v_scale_ptr,
    eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_kps,
    stride_kph,
    stride_vps,
    stride_vph,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    KV_SCALED: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    slot = tl.load(out_loc_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    dtype = q_ptr.dtype.element_ty
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs, mask=offs < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs, mask=offs < HALF, other=0.0)
    cos = cos.to(tl.float32).to(dtype).to(tl.float32)[None, :]
    sin = sin.to(tl.float32).to(dtype).to(tl.float32)[None, :]

    q1, q2, offs_h, offs_d, mask = _norm_rope_heads(
        q_ptr,
        token,
        stride_qt,
        stride_qh,
        q_weight_ptr,
        eps,
        cos,
        sin,
        NUM_Q_HEADS,
        HALF,
        HAS_NORM,
        BLOCK_QH,
        BLOCK_HALF,
    )
    q_row = q_ptr + token * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    tl.store(q_row, q1, mask=mask)
    tl.store(q_row + HALF, q2, mask=mask)

    k1, k2, offs_h, offs_d, mask = _norm_rope_heads(
        k_ptr,
        token,
        stride_kt,
        stride_kh,
        k_weight_ptr,
        eps,
        cos,
        sin,
        NUM_KV_HEADS,
        HALF,
        HAS_NORM,
        BLOCK_KH,
        BLOCK_HALF,
    )
    k_slot = k_pool_ptr + slot * stride_kps + offs_h[:, None] * stride_kph + offs_d[None, :]
    v_row = v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    v_slot = v_pool_ptr + slot * stride_vps + offs_h[:, None] * stride_vph + offs_d[None, :]
    v1 = tl.load(v_row, mask=mask)
    v2 = tl.load(v_row + HALF, mask=mask)
    if KV_SCALED:  # an fp8 pool: value / its head's scale, as KVPool.store quantizes
        k_scale = tl.load(k_scale_ptr + offs_h, mask=offs_h < NUM_KV_HEADS, other=1.0)[:, None]
        v_scale = tl.load(v_scale_ptr + offs_h, mask=offs_h < NUM_KV_HEADS, other=1.0)[:, None]
        tl.store(k_slot, to_fp8(k1, k_scale), mask=mask)
        tl.store(k_slot + HALF, to_fp8(k2, k_scale), mask=mask)
        tl.store(v_slot, to_fp8(v1, v_scale), mask=mask)
        tl.store(v_slot + HALF, to_fp8(v2, v_scale), mask=mask)
    else:
        tl.store(k_slot, k1.to(k_pool_ptr.dtype.element_ty), mask=mask)
        tl.store(k_slot + HALF, k2.to(k_pool_ptr.dtype.element_ty), mask=mask)
        tl.store(v_slot, v1.to(v_pool_ptr.dtype.element_ty), mask=mask)
        tl.store(v_slot + HALF, v2.to(v_pool_ptr.dtype.element_ty), mask=mask)


def rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    out_loc: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Normalise (when norm weights are given) and rotate q and k, rotate q in place, write the
    rotated k and v to `out_loc` of the pools. Returns q.

    q: [T, Hq, D], k and v: [T, Hk, D], each with a contiguous last dim (views into a fused qkv
    output are fine) and one dtype; positions: [T] int; cos_sin_cache: [max_positions, D] with
    cos in the first half of each row (RotaryEmbedding.cos_sin); pools: [slots, Hk, D];
    out_loc: [T] distinct slots; norm weights: [D] (both or neither). fp8 pools (float8_e4m3fn)
    need k_scale, v_scale: [Hk] float32; k and v are stored divided by them, saturated at +-448.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} do not match q {tuple(q.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if k_pool.shape[1:] != k.shape[1:] or v_pool.shape[1:] != k.shape[1:]:
        raise ValueError(
            f"pools {tuple(k_pool.shape)}, {tuple(v_pool.shape)} do not hold [Hk, D] = {tuple(k.shape[1:])}"
        )
    if cos_sin_cache.shape[-1] != head_dim or head_dim % 2:
        raise ValueError(f"cos_sin_cache rows hold {cos_sin_cache.shape[-1]} values, head dim is {head_dim}")
    quantized = k_pool.dtype == torch.float8_e4m3fn
    if quantized != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        raise ValueError("fp8 pools need k_scale and v_scale, other pools neither")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("give both q and k norm weights, or neither")
    for name, t in (
        ("q", q),
        ("k", k),
        ("v", v),
        ("k_pool", k_pool),
        ("v_pool", v_pool),
        ("cos_sin_cache", cos_sin_cache),
    ):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim")
    if num_tokens == 0:
        return q
    has_norm = q_norm_weight is not None
    half = head_dim // 2
    _rope_store_kernel[(num_tokens,)](
        q,
        k,
        v,
        positions,
        cos_sin_cache,
        q_norm_weight if has_norm else cos_sin_cache,
        k_norm_weight if has_norm else cos_sin_cache,
        k_pool,
        v_pool,
        out_loc,
        k_scale if quantized else cos_sin_cache,
        v_scale if quantized else cos_sin_cache,
        eps,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_sin_cache.stride(0),
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        HAS_NORM=has_norm,
        KV_SCALED=quantized,
        BLOCK_QH=triton.next_power_of_2(num_q_heads),
        BLOCK_KH=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4,
    )
    return q
