"""The write step of the KV life cycle in Triton: this pass's K and V go to slots `out_loc`.

One launch writes both K and V (the torch path is two index_put calls), reading k and v in
whatever layout the qkv projection left them (last dim contiguous).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_pool_ptr, v_pool_ptr, out_loc_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kps, stride_kph, stride_vps, stride_vph,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(out_loc_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    tl.store(k_pool_ptr + slot * stride_kps + offs_h[:, None] * stride_kph + offs_d[None, :],
             k.to(k_pool_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(v_pool_ptr + slot * stride_vps + offs_h[:, None] * stride_vph + offs_d[None, :],
             v.to(v_pool_ptr.dtype.element_ty), mask=mask)


def store_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out_loc: torch.Tensor) -> None:
    """k_pool[out_loc] = k; v_pool[out_loc] = v.

    k_pool, v_pool: [slots, Hk, D]; k, v: [T, Hk, D] with the last dim contiguous; out_loc: [T]
    int32 or int64 slots on the device (distinct, as the allocator hands them out).
    """
    num_tokens, num_heads, head_dim = k.shape
    if v.shape != k.shape or k_pool.shape[1:] != k.shape[1:] or v_pool.shape[1:] != k.shape[1:]:
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} do not fit pools "
                         f"{tuple(k_pool.shape)}, {tuple(v_pool.shape)}")
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    assert k_pool.stride(-1) == 1 and v_pool.stride(-1) == 1
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_pool, v_pool, out_loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )


def store_kv_reference(k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out_loc: torch.Tensor) -> None:
    k_pool[out_loc.long()] = k
    v_pool[out_loc.long()] = v
