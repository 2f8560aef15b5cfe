"""Pass 1 of paged decode attention, the Triton kernel (attention_decode.py launches it and says
how it is split; the module docstring there is the overview). One program per (kv head, request,
split): its slice of the request's keys, an online softmax for the kv head's group of q heads,
then the partial output and log-sum-exp, or the output itself with one split.
"""

from __future__ import annotations

import triton
import triton.language as tl

from minfer.kernels.common import attend_blocks, fp8_pool_operand, prefetch_l2
from minfer.kernels.new_kv import finish_decode_token, rope_factors
from minfer.kernels.pdl import pdl_start


@triton.jit
def decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    page_table_ptr,
    table_idx_ptr,
    seq_lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    new_k_ptr,
    new_v_ptr,
    positions_ptr,
    cos_sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    out_loc_ptr,
    eps,
    sm_scale_log2,
    stride_qb,
    stride_qh,
    stride_nkb,
    stride_nkh,
    stride_nvb,
    stride_nvh,
    stride_cs,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_oh,
    stride_page_row,
    num_splits,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIRECT_OUT: tl.constexpr,
    KV_SCALED: tl.constexpr,
    NEW_KV: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL_RELEASE: tl.constexpr,
    PDL_WAIT: tl.constexpr,
    WINDOW: tl.constexpr,
    PREFETCH: tl.constexpr,
    LINES: tl.constexpr,
    LINE_ELEMENTS: tl.constexpr,
    V_PTX_WIDEN: tl.constexpr,
):
    # Grid (kv head, request, split), kv head fastest: one request's heads, which read nearby parts
    # of the same slot rows, run side by side. H200, graph-timed, Qwen3-0.6B heads, B=256 ctx~1024
    # (scripts/gpu_decode_layout.py): bf16 254.8 -> 250.7 us, fp8 217.8 -> 213.8 against the
    # (request, kv head, split) order.
    kv_head = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(0)

    # Until pdl_start this reads only what no kernel of the step writes: the lengths, page table,
    # positions and slots the host staged, the cos/sin table, and the slots of the first key
    # block, whose K and V rows (written by earlier steps) it asks L2 for. Launched early (a batch
    # CHAIN_BANDS names), the kernel does this while the qkv product runs, so the chain after the
    # wait (length -> page table -> slots -> keys) starts at the keys, from L2.
    seq_len = tl.load(seq_lens_ptr + b)
    row = tl.load(table_idx_ptr + b).to(tl.int64)
    first = 0  # the first key the new token sees: with a sliding window, seq_len - WINDOW
    if WINDOW > 0:
        first = tl.maximum(seq_len - WINDOW, 0)
    chunk = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_h
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    page_row = page_table_ptr + row * stride_page_row
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    k_scale = 1.0
    v_scale = 1.0
    if KV_SCALED:
        k_scale = tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)
    if NEW_KV:
        slot = tl.load(out_loc_ptr + b).to(tl.int64)
        position = tl.load(positions_ptr + b).to(tl.int64)
        cos, signed_sin = rope_factors(
            cos_sin_ptr, position, stride_cs, offs_d, d_mask, HEAD_DIM // 2, q_ptr.dtype.element_ty
        )
    if PREFETCH:
        first_keys = start + offs_n
        in_slice = first_keys < end
        first_slots = tl.load(page_row + first_keys, mask=in_slice, other=0).to(tl.int64)
        offs_line = tl.arange(0, LINES) * LINE_ELEMENTS  # one address per 128-byte line of a row
        lines = in_slice[:, None] & (offs_line < HEAD_DIM)[None, :]
        prefetch_l2(k_head + first_slots[:, None] * stride_ks + offs_line[None, :], lines)
        prefetch_l2(v_head + first_slots[:, None] * stride_vs + offs_line[None, :], lines)

    pdl_start(PDL_RELEASE, PDL_WAIT)  # the merge, or o_proj's gemv, may start meanwhile
    # this split's rows of the partials, contiguous [B, Hq, num_splits, HEAD_DIM] and [B, Hq, num_splits]
    lse_idx = (b * GROUP * num_kv_heads + heads) * num_splits + split
    if not DIRECT_OUT:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if start >= end:  # a slice past the end of a short sequence: the merge weighs it zero
            tl.store(part_lse_ptr + lse_idx, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=h_mask)
            return

    if NEW_KV:  # q, k, v as the qkv projection left them: rope_store's work happens here
        newest = seq_len - 1
        q = finish_decode_token(
            q_ptr + b * stride_qb,
            stride_qh,
            heads,
            h_mask,
            new_k_ptr + b * stride_nkb + kv_head * stride_nkh,
            new_v_ptr + b * stride_nvb + kv_head * stride_nvh,
            k_head + slot * stride_ks,
            v_head + slot * stride_vs,
            (start <= newest) & (newest < end),
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
            HEAD_DIM,
            HAS_NORM,
            KV_SCALED,
        )
    else:
        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=h_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    if KV_SCALED:  # an fp8 cache: K's scale folds into the scores, V's into the output
        sm_scale_log2 = sm_scale_log2 * k_scale
        q = fp8_pool_operand(q)
    # The new token sees every key of [first, seq_len): bounds masking only (q_pos unused).
    m_i, l_i, acc = attend_blocks(
        q,
        m_i,
        m_i,
        l_i,
        acc,
        page_row,
        k_head,
        v_head,
        stride_ks,
        stride_vs,
        start,
        end,
        sm_scale_log2,
        offs_n,
        offs_d,
        d_mask,
        True,
        False,
        BLOCK_N,
        0,
        V_PTX_WIDEN,
    )

    # An empty slice (split past the end) has l_i = 0: its output is 0 and its lse -inf.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if KV_SCALED:
        o = o * v_scale
    hd_mask = h_mask[:, None] & d_mask[None, :]
    if DIRECT_OUT:  # a single split: no merge pass
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=hd_mask,
        )
    else:
        tl.store(part_out_ptr + lse_idx[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :], o, mask=hd_mask)
        tl.store(part_lse_ptr + lse_idx, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=h_mask)
