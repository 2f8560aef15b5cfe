"""Long-prompt extend attention for Hopper, written in Gluon: the softmax of one key block runs
while the tensor cores multiply the previous block's probabilities by its values.

Why a second extend kernel: a long prompt's chunks are compute-bound, and the Triton kernel
(attention_extend.py) reaches 54% of the tensor cores' rate there. Within one of its programs
each key block's product QK^T, its softmax and the product PV run one after another: Triton
waits for every tensor-core product right where it is issued, so the exp2 work never overlaps
them. Here the waits are placed by hand (FlashAttention-3's overlap within a warpgroup): block
j's scores are issued, then block j - 1's PV product, and only the scores are waited for; block
j's softmax runs while PV j - 1 is in flight. Q sits in registers as the products' left operand,
so each key block crosses shared memory once per warpgroup (the products read their shared
operands at close to shared memory's bandwidth).

K/V are gathered through the page table (no TMA: a block's rows are scattered), with cp.async
into a ring of STAGES shared-memory slots per tensor. Copy group g holds K_g and V_{g-1}; it is
issued right after the barrier that starts iteration g - STAGES + 1, when both slots it
overwrites have been read by every warp, so a copy has STAGES - 1 iterations to land.

Measured on an H100 (scripts/gpu_extend_one.py, Llama-8B heads, an 8k chunk over a 16k prefix):
466 TFLOP/s against the Triton kernel's 435. What did not pay, in the same call: one key block
per loop trip (427: see the loop), issuing block j + 1's scores before block j's softmax so both
products overlap it (415-425: more registers live, the tensor pipe less busy), 128-key blocks
(they spill), Q read from shared memory (451). ncu puts the rest in the two warpgroups running
in lockstep between barriers, each with one warp per scheduler: FlashAttention-3 splits off a
producer warp (mbarriers instead of the per-block barrier) and alternates the warpgroups.

Scope: the engine's long launches only (attention_extend.launch_config's LONG_CONFIG case):
bf16 or fp16 pools with 128-dim heads, no sliding window, compute capability 9.x (wgmma). The
Triton kernel serves everything else, and on the CPU this file is never compiled.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LOG2E = 1.4426950408889634
# (BLOCK_M, BLOCK_N, num_warps, STAGES): 128 query rows in two warpgroups of 64, 64-key blocks,
# 4 slots each of K and V (16 KB each) besides Q (32 KB): 160 KB, one program per SM. 128-key
# blocks need more than the 255 registers a thread has (they spill; scripts/kernel_registers.py).
# BLOCK_M must equal attention_extend.LONG_CONFIG's: the engine's tile maps are made for that.
CONFIG = (128, 64, 8, 4)


@functools.cache
def supported(device: torch.device) -> bool:
    """Whether this kernel can run on `device`: Hopper (wgmma is sm_90 only)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def applies(q: torch.Tensor, k_pool: torch.Tensor, window: int | None) -> bool:
    """Whether a long launch over these tensors can take this kernel."""
    return (
        window is None
        and q.shape[-1] == 128
        and q.dtype in (torch.bfloat16, torch.float16)
        and k_pool.dtype == q.dtype
        and supported(q.device)
    )


@gluon.jit
def _gather_rows(buf, head_ptr, slots, stride, valid, offs_d):
    """Start cp.async copies of the pool rows `slots` of one head into the slot `buf`; rows
    that are not `valid` are filled with zeros and read nothing."""
    ptrs = head_ptr + slots.to(gl.int64)[:, None] * stride + offs_d[None, :]
    async_copy.async_copy_global_to_shared(buf, ptrs, mask=valid[:, None])


@gluon.jit
def _block_slots(page_row, block, end, offs_n, BLOCK_N: gl.constexpr):
    """(pool slots, in-bounds mask) of key block `block`'s positions. The slots stay int32
    until an address is made of them: they are carried across an iteration."""
    pos = block * BLOCK_N + offs_n
    valid = pos < end
    return gl.load(page_row + pos, mask=valid, other=0), valid


@gluon.jit
def _online_softmax(s, m_i, l_i, sm_scale_log2):
    """One block's step of the online softmax over raw scores s (base 2, scaled here): the new
    running max, the factor for what was accumulated before, the block's probabilities and the
    new running sum."""
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_scaled = m_new * sm_scale_log2
    alpha = gl.exp2(m_i * sm_scale_log2 - m_scaled)
    p = gl.exp2(s * sm_scale_log2 - m_scaled[:, None])
    return m_new, alpha, p, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _attend_block(
    j, q_operand, k_buf, v_buf, p_prev, acc, m_i, l_i, zeros, next_slots, next_valid, prev_slots,
    prev_valid, page_row, k_head, v_head, stride_ks, stride_vs, end, unmasked_end, q_pos, key_offs,
    offs_n, offs_d, sm_scale_log2, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
    P_OPERAND: gl.constexpr, O_MMA: gl.constexpr,
):  # fmt: skip
    """Iteration j >= 1: refill the slots iteration j - 1 read, issue block j's scores and block
    j - 1's PV product (probabilities p_prev), and run block j's softmax while PV is in flight.
    Returns block j's probabilities (the next PV operand) and the updated state."""
    async_copy.wait_group(STAGES - 2)
    gl.thread_barrier()  # every warp is past iteration j - 1: its slots may be refilled
    fence_async_shared()
    # group j + STAGES - 1: K into the slot K_{j-1} left, V_{j+STAGES-2} into V_{j-2}'s
    _gather_rows(k_buf.index((j + STAGES - 1) % STAGES), k_head, next_slots, stride_ks, next_valid, offs_d)
    _gather_rows(v_buf.index((j + STAGES - 2) % STAGES), v_head, prev_slots, stride_vs, prev_valid, offs_d)
    async_copy.commit_group()
    prev_slots = next_slots
    prev_valid = next_valid
    next_slots, next_valid = _block_slots(page_row, j + STAGES, end, offs_n, BLOCK_N)

    s_token = warpgroup_mma(
        q_operand, k_buf.index(j % STAGES).permute((1, 0)), zeros, use_acc=False, is_async=True
    )
    acc_token = warpgroup_mma(p_prev, v_buf.index((j - 1) % STAGES), acc, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s_token,))
    # The softmax sits inside the branches: ptxas puts a wgmma wait at the top of its basic
    # block, so the wait for PV below (in the join block) then comes after the exps it should
    # overlap, rather than before them.
    if j * BLOCK_N >= unmasked_end:  # a block that reaches the rows' own positions
        s = gl.where(key_offs[None, :] <= (q_pos - j * BLOCK_N)[:, None], s, float("-inf"))
        m_new, alpha, p, l_i = _online_softmax(s, m_i, l_i, sm_scale_log2)
    else:
        m_new, alpha, p, l_i = _online_softmax(s, m_i, l_i, sm_scale_log2)
    acc, p_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc_token, p_prev))
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_MMA))[:, None]
    p_next = gl.convert_layout(p.to(p_prev.dtype), P_OPERAND)
    return p_next, acc, m_new, l_i, next_slots, next_valid, prev_slots, prev_valid


@gluon.jit
def _extend_wgmma_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    page_table_ptr,
    table_idx_ptr,
    prefix_lens_ptr,
    seq_lens_ptr,
    cu_extend_lens_ptr,
    tiles_ptr,
    sm_scale_log2,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_page_row,
    stride_tiles,
    GROUP: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    HEAVY_FIRST: gl.constexpr,
    TILED: gl.constexpr,
    num_warps: gl.constexpr,
):
    if TILED:  # the tile map of attention_extend.extend_tiles
        b = gl.load(tiles_ptr + gl.program_id(0))
        block_m = gl.load(tiles_ptr + stride_tiles + gl.program_id(0))
        head = gl.program_id(1)
    else:
        block_m = gl.program_id(0)
        if HEAVY_FIRST:
            block_m = gl.num_programs(0) - 1 - block_m
        b = gl.program_id(1)
        head = gl.program_id(2)
    q_start = gl.load(cu_extend_lens_ptr + b)
    extend_len = gl.load(cu_extend_lens_ptr + b + 1) - q_start
    if block_m * BLOCK_M < extend_len:
        prefix = gl.load(prefix_lens_ptr + b)
        seq_len = gl.load(seq_lens_ptr + b)
        row = gl.load(table_idx_ptr + b).to(gl.int64)
        kv_head = head // GROUP
        dtype: gl.constexpr = q_ptr.dtype.element_ty

        # Copies and the q/out tiles: 16 bytes per thread along the head dim.
        LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
        # Products: each warp owns 16 query rows, so row reductions stay within a warp.
        S_MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
        )
        O_MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        P_OPERAND: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_MMA, k_width=2)
        TILE: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

        offs_m = block_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LOAD))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LOAD))
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD))
        m_mask = offs_m < extend_len
        q_rows = (q_start + offs_m).to(gl.int64)
        q = gl.load(
            q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
            mask=m_mask[:, None],
            other=0.0,
        )
        # Q into the registers of the scores' left operand, through shared memory (which the
        # allocator hands on to the K/V ring once it is read).
        q_staging = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], TILE, q)
        gl.thread_barrier()
        q_operand = q_staging.load(gl.DotOperandLayout(operand_index=0, parent=S_MMA, k_width=2))
        k_buf = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], TILE)
        v_buf = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], TILE)

        page_row = page_table_ptr + row * stride_page_row
        k_head = k_ptr + kv_head * stride_kh
        v_head = v_ptr + kv_head * stride_vh
        # Keys [0, end): the last row's position bounds them. Blocks from unmasked_end on reach
        # the block's own positions and take the causal mask.
        end = gl.minimum(seq_len, prefix + (block_m + 1) * BLOCK_M)
        unmasked_end = (prefix + block_m * BLOCK_M) // BLOCK_N * BLOCK_N
        num_blocks = gl.cdiv(end, BLOCK_N)
        q_pos = prefix + block_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_MMA))
        key_offs = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_MMA))

        # Groups 0 .. STAGES - 2 before the loop (group g: K_g, and V_{g-1} from g = 1 on).
        prev_slots, prev_valid = _block_slots(page_row, 0, end, offs_n, BLOCK_N)
        _gather_rows(k_buf.index(0), k_head, prev_slots, stride_ks, prev_valid, offs_d)
        async_copy.commit_group()
        for g in gl.static_range(1, STAGES - 1):
            slots, valid = _block_slots(page_row, g, end, offs_n, BLOCK_N)
            _gather_rows(k_buf.index(g), k_head, slots, stride_ks, valid, offs_d)
            _gather_rows(v_buf.index(g - 1), v_head, prev_slots, stride_vs, prev_valid, offs_d)
            async_copy.commit_group()
            prev_slots = slots
            prev_valid = valid
        # The slots of group STAGES - 1's K block, read one iteration ahead of their copies.
        next_slots, next_valid = _block_slots(page_row, STAGES - 1, end, offs_n, BLOCK_N)

        zeros = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_MMA)
        # Iteration 0: block 0's scores and softmax; its PV product is issued in iteration 1.
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()
        fence_async_shared()
        _gather_rows(k_buf.index(STAGES - 1), k_head, next_slots, stride_ks, next_valid, offs_d)
        _gather_rows(v_buf.index(STAGES - 2), v_head, prev_slots, stride_vs, prev_valid, offs_d)
        async_copy.commit_group()
        prev_slots = next_slots
        prev_valid = next_valid
        next_slots, next_valid = _block_slots(page_row, STAGES, end, offs_n, BLOCK_N)
        s = warpgroup_mma(q_operand, k_buf.index(0).permute((1, 0)), zeros, use_acc=False)
        if unmasked_end == 0:
            s = gl.where(key_offs[None, :] <= q_pos[:, None], s, float("-inf"))
        m_i, _, p, l_i = _online_softmax(
            s,
            gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, S_MMA)),
            gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, S_MMA)),
            sm_scale_log2,
        )
        p_op = gl.convert_layout(p.to(dtype), P_OPERAND)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, O_MMA)

        # Two blocks per trip: the probabilities being written (p_b, then p_a) are another value
        # than those the PV product in flight reads, where one p carried around the loop ties
        # them together. Measured: 466 TFLOP/s against 427 with one block per trip.
        p_a = p_op
        for pair in range(0, (num_blocks - 1) // 2):
            j = 1 + 2 * pair
            p_b, acc, m_i, l_i, next_slots, next_valid, prev_slots, prev_valid = _attend_block(
                j, q_operand, k_buf, v_buf, p_a, acc, m_i, l_i, zeros, next_slots, next_valid, prev_slots,
                prev_valid, page_row, k_head, v_head, stride_ks, stride_vs, end, unmasked_end, q_pos,
                key_offs, offs_n, offs_d, sm_scale_log2, STAGES, BLOCK_N, P_OPERAND, O_MMA,
            )  # fmt: skip
            p_a, acc, m_i, l_i, next_slots, next_valid, prev_slots, prev_valid = _attend_block(
                j + 1, q_operand, k_buf, v_buf, p_b, acc, m_i, l_i, zeros, next_slots, next_valid, prev_slots,
                prev_valid, page_row, k_head, v_head, stride_ks, stride_vs, end, unmasked_end, q_pos,
                key_offs, offs_n, offs_d, sm_scale_log2, STAGES, BLOCK_N, P_OPERAND, O_MMA,
            )  # fmt: skip
        if (num_blocks - 1) % 2 == 1:
            p_a, acc, m_i, l_i, next_slots, next_valid, prev_slots, prev_valid = _attend_block(
                num_blocks - 1, q_operand, k_buf, v_buf, p_a, acc, m_i, l_i, zeros, next_slots, next_valid,
                prev_slots, prev_valid, page_row, k_head, v_head, stride_ks, stride_vs, end, unmasked_end,
                q_pos, key_offs, offs_n, offs_d, sm_scale_log2, STAGES, BLOCK_N, P_OPERAND, O_MMA,
            )  # fmt: skip
        p_op = p_a

        # The last block's PV product (its V is in group num_blocks).
        async_copy.wait_group(0)
        gl.thread_barrier()
        fence_async_shared()
        acc = warpgroup_mma(p_op, v_buf.index((num_blocks - 1) % STAGES), acc)

        o = acc / gl.convert_layout(l_i, gl.SliceLayout(1, O_MMA))[:, None]
        o = gl.convert_layout(o.to(out_ptr.dtype.element_ty), LOAD)
        gl.store(
            out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
            o,
            mask=m_mask[:, None],
        )


def extend_attention_wgmma(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    out: torch.Tensor,
    page_table: torch.Tensor,
    table_idx: torch.Tensor,
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_extend_lens: torch.Tensor,
    max_extend_len: int,
    scale: float,
    tiles: torch.Tensor | None,
    heavy_first: bool,
) -> None:
    """attention_extend.extend_attention's long launch on this kernel (arguments as there;
    `applies` must hold). Writes `out`."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_m, block_n, num_warps, stages = CONFIG
    if tiles is not None:
        grid = (tiles.shape[1], num_heads)
    else:
        grid = (triton.cdiv(max_extend_len, block_m), table_idx.shape[0], num_heads)
    _extend_wgmma_kernel[grid](
        q,
        k_pool,
        v_pool,
        out,
        page_table,
        table_idx,
        prefix_lens,
        seq_lens,
        cu_extend_lens,
        tiles if tiles is not None else seq_lens,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        out.stride(0),
        out.stride(1),
        page_table.stride(0),
        tiles.stride(0) if tiles is not None else 16,
        GROUP=num_heads // k_pool.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        STAGES=stages,
        HEAVY_FIRST=heavy_first,
        TILED=tiles is not None,
        num_warps=num_warps,
    )
