"""A pass's new K/V on their way into the pool, and the Triton helpers that finish them.

`NewKV` is what the model hands the attention on CUDA: k and v as the qkv projection left
them, with what finishes them (Qwen3's per-head RMSNorm, RoPE) and the slots they go to. The
helpers below do that work on tiles of head rows; the rope_store kernel (one program per
token) and the decode attention kernel's prologue (one program per request, kv head and split)
both call them, so the two round identically.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from minfer.kernels.common import to_fp8


class NewKV(NamedTuple):
    """A decode pass's own k and v as the qkv projection left them, with what finishes them
    and q: RoPE at `positions` (after a per-head RMSNorm when the norm weights are given), and
    the pool slots `out_loc` the finished k and v go to. Handed to the decode attention kernel,
    which does this kernel's work in its prologue (attention_decode.py)."""

    k: torch.Tensor  # [T, Hk, D]
    v: torch.Tensor  # [T, Hk, D]
    positions: torch.Tensor  # [T]
    cos_sin: torch.Tensor  # [max_positions, D]: RotaryEmbedding.cos_sin
    out_loc: torch.Tensor  # [T]
    q_norm_weight: torch.Tensor | None = None  # [D]
    k_norm_weight: torch.Tensor | None = None  # [D]
    eps: float = 0.0


def decode_prologue_args(
    new_kv: NewKV | None, q: torch.Tensor, seq_lens: torch.Tensor
) -> tuple[tuple, tuple]:
    """The decode attention kernel's prologue arguments (new k and v, positions, cos/sin table,
    norm weights, out_loc, eps) and strides; without `new_kv` the prologue is compiled out and
    any tensor stands in for them."""
    if new_kv is None:
        return (q, q, seq_lens, q, q, q, seq_lens, 0.0), (0, 0, 0, 0, 0)
    k, v = new_kv.k, new_kv.v
    if k.shape != (q.shape[0], *k.shape[1:]) or v.shape != k.shape or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"new k {tuple(k.shape)} / v {tuple(v.shape)} do not fit q {tuple(q.shape)}")
    norm_w = (new_kv.q_norm_weight, new_kv.k_norm_weight) if new_kv.q_norm_weight is not None else (q, q)
    args = (k, v, new_kv.positions, new_kv.cos_sin, *norm_w, new_kv.out_loc, new_kv.eps)
    return args, (k.stride(0), k.stride(1), v.stride(0), v.stride(1), new_kv.cos_sin.stride(0))


@triton.jit
def rope_factors(cos_sin_ptr, pos, stride_cs, offs_d, d_mask, HALF: tl.constexpr, dtype: tl.constexpr):
    """cos and signed sin of position `pos` spread over a whole head row ([1, BLOCK_D]): both
    halves use frequency d % HALF, and the first half's sin carries rotate-half's minus.
    Rounded to `dtype`, as the torch layer rounds its cos/sin table."""
    freq = offs_d % HALF
    row = cos_sin_ptr + pos * stride_cs
    cos = tl.load(row + freq, mask=d_mask, other=0.0).to(tl.float32).to(dtype).to(tl.float32)
    sin = tl.load(row + HALF + freq, mask=d_mask, other=0.0).to(tl.float32).to(dtype).to(tl.float32)
    return cos[None, :], tl.where(offs_d < HALF, -sin, sin)[None, :]


@triton.jit
def load_heads(x_ptr, stride_h, offs_h, h_mask, offs_d, d_mask, HEAD_DIM: tl.constexpr):
    """Rows `x_ptr + h * stride_h` (h in offs_h) of one token, in float32, as themselves and
    with their halves swapped ([BLOCK_H, BLOCK_D] each): what `rotate_heads` finishes. Apart, so
    a kernel can issue these loads before others that wait on an earlier load (rope_store)."""
    mask = h_mask[:, None] & d_mask[None, :]
    rows = x_ptr + offs_h[:, None] * stride_h
    swapped = (offs_d + HEAD_DIM // 2) % HEAD_DIM
    x = tl.load(rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    xs = tl.load(rows + swapped[None, :], mask=mask, other=0.0).to(tl.float32)
    return x, xs


@triton.jit
def rotate_heads(
    x,
    xs,
    offs_d,
    d_mask,
    weight_ptr,
    eps,
    cos,
    signed_sin,
    dtype: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """`load_heads`' rows RMS-normalised per head when HAS_NORM, then rotated: [BLOCK_H,
    BLOCK_D] in `dtype`, not stored.

    The swapped copy makes the rotation one elementwise expression over the whole row: out =
    x cos + swap(x) signed_sin (the minus of rotate-half is exact, so this rounds as the layer's
    x1 cos - x2 sin does)."""
    if HAS_NORM:
        swapped = (offs_d + HEAD_DIM // 2) % HEAD_DIM
        rstd = (1.0 / tl.sqrt(tl.sum(x * x, 1) / HEAD_DIM + eps))[:, None]
        w = tl.load(weight_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        ws = tl.load(weight_ptr + swapped, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        x = ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
        xs = ((xs * rstd).to(dtype).to(tl.float32) * ws).to(dtype).to(tl.float32)
    return ((x * cos).to(dtype).to(tl.float32) + (xs * signed_sin).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def finish_heads(
    x_ptr,
    stride_h,
    offs_h,
    h_mask,
    offs_d,
    d_mask,
    weight_ptr,
    eps,
    cos,
    signed_sin,
    HEAD_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """Rows `x_ptr + h * stride_h` (h in offs_h) of one token, RMS-normalised per head when
    HAS_NORM, then rotated: [BLOCK_H, BLOCK_D] in x's dtype, not stored (`load_heads`, then
    `rotate_heads`)."""
    x, xs = load_heads(x_ptr, stride_h, offs_h, h_mask, offs_d, d_mask, HEAD_DIM)
    return rotate_heads(
        x, xs, offs_d, d_mask, weight_ptr, eps, cos, signed_sin, x_ptr.dtype.element_ty, HEAD_DIM, HAS_NORM
    )


@triton.jit
def store_kv(k_dst, v_dst, k, v, k_scale, v_scale, mask, KV_SCALED: tl.constexpr):
    """Rotated k and v rows into their pool slots; an fp8 pool stores value / its head's scale,
    as KVPool.store quantizes."""
    if KV_SCALED:
        tl.store(k_dst, to_fp8(k, k_scale), mask=mask)
        tl.store(v_dst, to_fp8(v, v_scale), mask=mask)
    else:
        tl.store(k_dst, k.to(k_dst.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_dst.dtype.element_ty), mask=mask)


@triton.jit
def finish_decode_token(
    q_rows,
    stride_qh,
    heads,
    h_mask,
    new_k_row,
    new_v_row,
    k_dst,
    v_dst,
    write_kv,
    cos,
    signed_sin,
    q_weight_ptr,
    k_weight_ptr,
    eps,
    k_scale,
    v_scale,
    offs_h,
    offs_d,
    d_mask,
    HEAD_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr,
    KV_SCALED: tl.constexpr,
):
    """rope_store's work for one decode token and one kv head, inside the decode attention
    kernel (decode_split_kernel.py): returns the group's q rows normalised and rotated, and, when
    `write_kv` (the program whose key slice holds the new position), writes the head's new k
    and v to their slot first. Same helpers, same rounding as the rope_store kernel; `cos` and
    `signed_sin` are `rope_factors` of the token's position, which the caller reads before its
    wait for q (they depend only on the step's staged positions)."""
    q = finish_heads(
        q_rows,
        stride_qh,
        heads,
        h_mask,
        offs_d,
        d_mask,
        q_weight_ptr,
        eps,
        cos,
        signed_sin,
        HEAD_DIM,
        HAS_NORM,
    )
    if write_kv:
        one_row = offs_h < 1  # the head's k as a one-row tile: finish_heads works on tiles
        k = finish_heads(
            new_k_row,
            0,
            offs_h,
            one_row,
            offs_d,
            d_mask,
            k_weight_ptr,
            eps,
            cos,
            signed_sin,
            HEAD_DIM,
            HAS_NORM,
        )
        mask = one_row[:, None] & d_mask[None, :]
        v = tl.load(new_v_row + offs_h[:, None] * 0 + offs_d[None, :], mask=mask)
        at = offs_h[:, None] * 0 + offs_d[None, :]
        store_kv(k_dst + at, v_dst + at, k, v, k_scale, v_scale, mask, KV_SCALED)
        tl.debug_barrier()  # the key loop reads them back through the page table
    return q
