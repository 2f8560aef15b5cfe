"""Rotary position embedding in Triton, applied in place to q and k ("rotate half" layout).

One program per token rotates all of its query and key heads with one gather of the token's
cos/sin row. Rounding follows minfer/layers/rotary.py (and Hugging Face): cos and sin are
rounded to the activation dtype, and each product and the sum are rounded as the separate
torch ops round them. Results agree with the torch layer to one unit in the last place (bit
for bit in Triton's CPU interpreter for fp16; on an H200 about a fifth of bf16 results differ
by one unit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, token, stride_t, stride_h, cos, sin,
                  NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)
    first = x_ptr + token * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    dtype = x_ptr.dtype.element_ty
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = ((x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)).to(dtype)
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF, out2, mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, positions_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    dtype = q_ptr.dtype.element_ty
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_d, mask=d_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_d, mask=d_mask, other=0.0)
    cos = cos.to(tl.float32).to(dtype).to(tl.float32)[None, :]
    sin = sin.to(tl.float32).to(dtype).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, token, stride_qt, stride_qh, cos, sin, NUM_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF)
    _rotate_heads(k_ptr, token, stride_kt, stride_kh, cos, sin, NUM_K_HEADS, HALF, BLOCK_KH, BLOCK_HALF)


def apply_rope_inplace(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                       cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q: [T, Hq, D] and k: [T, Hk, D] in place; returns (q, k) for chaining.

    positions: [T] int on the device; cos_sin_cache: [max_positions, D], cos in the first half
    of each row and sin in the second (RotaryEmbedding.cos_sin). q and k need only their last
    dim contiguous (views into a fused qkv output are fine) and must share a dtype.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or k.dtype != q.dtype:
        raise ValueError(f"k {tuple(k.shape)} {k.dtype} does not match q {tuple(q.shape)} {q.dtype}")
    if cos_sin_cache.shape[-1] != head_dim:
        raise ValueError(f"cos_sin_cache rows hold {cos_sin_cache.shape[-1]} values, head dim is {head_dim}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("q, k and cos_sin_cache need a contiguous last dim to be rotated in place")
    if num_tokens == 0:
        return q, k
    half = head_dim // 2
    _rope_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HALF=half,
        BLOCK_QH=triton.next_power_of_2(num_q_heads), BLOCK_KH=triton.next_power_of_2(num_k_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4,
    )
    return q, k


def apply_rope_reference(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                         cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """minfer/layers/rotary.py RotaryEmbedding.forward, as a function (returns new tensors)."""
    cos, sin = cos_sin_cache[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
    cos = torch.cat([cos, cos], dim=-1)
    sin = torch.cat([sin, sin], dim=-1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    return rotate(q), rotate(k)
