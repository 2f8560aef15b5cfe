"""Everything between the qkv projection and attention, in one Triton kernel per layer:

    q, k  <- RMSNorm per head (Qwen3's q_norm / k_norm; skipped for models without it)
    q, k  <- RoPE ("rotate half" layout)
    k_pool[out_loc], v_pool[out_loc] <- k, v        (the write step of the KV life cycle)

q is rotated in place (it stays in the qkv projection's output, where attention reads it); k
and v go straight to their pool slots and are not written back. Done as separate kernels this
was four launches per layer (two norms over per-head rows, RoPE, KV store), each a few
microseconds even at batch 1, plus three extra round trips of q and k through memory. Small
decode batches skip even this launch: the decode attention kernel runs the same helpers
(kernels/new_kv.py) in its prologue.

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

from minfer.kernels.new_kv import NewKV, load_heads, rope_factors, rotate_heads, store_kv
from minfer.kernels.pdl import pdl_start, rope_store_pdl_args


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
    HEAD_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr,
    KV_SCALED: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL_RELEASE: tl.constexpr,
    PDL_WAIT: tl.constexpr,
):
    # Every load of the qkv row is issued first, before the loads that wait on one (cos and sin
    # on the position) and before any store: q, k and v are views of one qkv row, so the compiler
    # may not move a load of k above a store of q, and a warp issues in order. A launch over a
    # decode batch is a single wave, so its chain of dependent round trips to memory is its
    # duration (H100: 3.7-4.1 us at 48-256 tokens when q was stored before k was read).
    # Launched early (PDL_WAIT), the position and its cos/sin row (staged by the host, and a
    # table no kernel writes) are read before the wait, while the qkv product still runs.
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    slot = tl.load(out_loc_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    dtype = q_ptr.dtype.element_ty
    if PDL_WAIT:
        cos, signed_sin = rope_factors(cos_sin_ptr, pos, stride_cs, offs_d, d_mask, HEAD_DIM // 2, dtype)
    pdl_start(PDL_RELEASE, PDL_WAIT)  # attention may start its own early reads meanwhile
    offs_qh = tl.arange(0, BLOCK_QH)
    qh_mask = offs_qh < NUM_Q_HEADS
    q_rows = q_ptr + token * stride_qt
    q, qs = load_heads(q_rows, stride_qh, offs_qh, qh_mask, offs_d, d_mask, HEAD_DIM)
    offs_h = tl.arange(0, BLOCK_KH)
    h_mask = offs_h < NUM_KV_HEADS
    mask = h_mask[:, None] & d_mask[None, :]
    k, ks = load_heads(k_ptr + token * stride_kt, stride_kh, offs_h, h_mask, offs_d, d_mask, HEAD_DIM)
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if not PDL_WAIT:
        cos, signed_sin = rope_factors(cos_sin_ptr, pos, stride_cs, offs_d, d_mask, HEAD_DIM // 2, dtype)
    q = rotate_heads(q, qs, offs_d, d_mask, q_weight_ptr, eps, cos, signed_sin, dtype, HEAD_DIM, HAS_NORM)
    k = rotate_heads(k, ks, offs_d, d_mask, k_weight_ptr, eps, cos, signed_sin, dtype, HEAD_DIM, HAS_NORM)
    k_scale = 1.0
    v_scale = 1.0
    if KV_SCALED:
        k_scale = tl.load(k_scale_ptr + offs_h, mask=h_mask, other=1.0)[:, None]
        v_scale = tl.load(v_scale_ptr + offs_h, mask=h_mask, other=1.0)[:, None]
    tl.debug_barrier()  # q in place: every thread has read its (swapped) inputs before any writes
    tl.store(
        q_rows + offs_qh[:, None] * stride_qh + offs_d[None, :], q, mask=qh_mask[:, None] & d_mask[None, :]
    )
    k_dst = k_pool_ptr + slot * stride_kps + offs_h[:, None] * stride_kph + offs_d[None, :]
    v_dst = v_pool_ptr + slot * stride_vps + offs_h[:, None] * stride_vph + offs_d[None, :]
    store_kv(k_dst, v_dst, k, v, k_scale, v_scale, mask, KV_SCALED)


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
        HEAD_DIM=head_dim,
        HAS_NORM=has_norm,
        KV_SCALED=quantized,
        BLOCK_QH=triton.next_power_of_2(num_q_heads),
        BLOCK_KH=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
        **rope_store_pdl_args(q.device, k_pool.element_size() == 1),
    )
    return q


def store_new_kv(q: torch.Tensor, new_kv: NewKV, kv_pool, layer: int) -> torch.Tensor:
    """rope_store of a pass's `new_kv` into layer `layer` of `kv_pool` (a KVPool): q finished
    in place, k and v written to their slots."""
    norms = (
        (new_kv.q_norm_weight, new_kv.k_norm_weight, new_kv.eps) if new_kv.q_norm_weight is not None else ()
    )
    return rope_store(
        q,
        new_kv.k,
        new_kv.v,
        new_kv.positions,
        new_kv.cos_sin,
        kv_pool.k[layer],
        kv_pool.v[layer],
        new_kv.out_loc,
        *norms,
        **kv_pool.kernel_scales[layer],  # an fp8 pool's scales (none otherwise)
    )
