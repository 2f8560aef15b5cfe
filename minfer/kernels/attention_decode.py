"""Paged decode attention in Triton: one query token per request, K/V read through the page table.

Two passes, so that a single long request still spreads over the whole GPU:

  pass 1, grid (kv head, request, split): each program walks one slice of the request's
      positions, gathers K/V slot by slot via `page_table[table_idx[b], pos]`, and runs an
      online softmax for all the query heads that share this kv head (GQA: the group's
      queries are the rows of one small matrix, so each K/V row is read once per group).
      It writes its normalised partial output and its log-sum-exp (base 2).
  pass 2, grid (request, q head): merges the splits by their log-sum-exp (attention_merge.py).

Pass 1 can also do rope_store's work in its prologue (`new_kv`, used for small decode batches:
attention/triton_backend.py says when): each program normalises and rotates its q group, and
the program whose slice holds the new position writes the new K/V to the pool before its loop.

The split count is fixed per launch from static sizes (a CUDA graph replays the grid it
captured): the batch size, the number of kv heads and the page table's width. Each program
derives its slice from `seq_lens` on the device (ceil(seq_len / splits), rounded up to the key
block); a split past a short sequence's end writes lse = -inf and the merge weighs it zero.
With one split the first pass writes the output directly.
The kernel itself is in decode_split_kernel.py; this module chooses its launch.
"""

from __future__ import annotations

import torch
import triton

from minfer.kernels.attention_merge import merge_splits
from minfer.kernels.common import CACHE_LINE, num_sms, ptx_widens_e4m3
from minfer.kernels.decode_split_kernel import decode_split_kernel
from minfer.kernels.new_kv import NewKV, decode_prologue_args
from minfer.kernels.pdl import attention_chained, attention_pdl_args

LOG2E = 1.4426950408889634
MAX_SPLITS = 64
# Pass 1's launch configuration (scripts/gpu_check.py --sweep): on an H200 in bf16, Llama-8B heads,
# B=256, mean context 1028: 287 us, 3.77 TB/s of K/V read (88% of the 4.26 TB/s copy ceiling).
BLOCK_N = 64  # keys per inner step
# An fp8 pool: 128 keys per step (the fourth session's eagerly timed sweep; the eighth session's
# graph-timed one, with the register cap below, found it best at B=16, 64 and 256).
FP8_BLOCK_N = 128
NUM_WARPS = 4
NUM_STAGES = 3
# Not kept: a loop that issues the next key block's loads before this block's products (one more
# block of K/V held as stored). Graph-timed on an H200 (gpu_decode_layout.py, Qwen3-0.6B heads,
# twenty-fourth session) it was slower at every batch and launch tried: bf16 B=256 255 -> 283 us
# at best, fp8 B=256 185 -> 343 us at best (the held fp8 block spills at the register cap).
#
# An fp8 pool's V is widened to fp16 where it is loaded, in PTX (common.widen_e4m3_rows, compute
# capability 8.9 on): the launch compiles to 1,432 SASS instructions instead of 1,912 and 142
# registers instead of 200, which lets it take five stages, two shared-memory buffers of K/V, so
# a program's next block is in flight while it computes this one (two programs an SM, 107 KB of
# shared memory each). H100, graph-timed, Qwen3-0.6B heads (gpu_decode_layout.py --widen): B=256
# 201.9 -> 195.6 us, B=128 110.4 -> 107.5, B=64 69.3 -> 62.1, B=32 45.5 -> 39.1, B=16 22.0 ->
# 23.1 (three stages would give 20.4 there; under 32 running is ~5% of decode, so one launch).
# Offline fp8 +1.0% (docs/BENCHMARKS.md, twenty-sixth session). FP8_PTX_WIDEN: for A/B runs.
FP8_PTX_WIDEN = True
FP8_WIDENED_STAGES = 5
# Without the widening the kernel takes 200 registers uncapped: two programs per SM with one
# buffer, too few loads in flight (ncu, B=256: 2.40 TB/s). Capped at 168 three fit, no spills:
# 218 -> 185 us at B=256 (128 spills: 209 us). scripts/gpu_decode_layout.py --registers.
FP8_MAX_REGISTERS = 168


def choose_num_splits(
    batch_size: int, num_kv_heads: int, max_context: int, device: torch.device, block_n: int = BLOCK_N
) -> int:
    """Splits per (request, kv head), from sizes that stay fixed while a CUDA graph replays.

    Aim for about two programs per SM in pass 1 when the batch alone does not fill the GPU,
    never more splits than key blocks in the longest possible sequence, at most MAX_SPLITS.
    Measured on an H200 (Llama-8B heads, do_bench medians): B=1 at 32k context 88 us with 32
    splits, 95 us with 64, 102 us with 16; B=64 at mean context 1084 within 3% for 1..4 splits.
    """
    sms = num_sms(device)
    want = triton.cdiv(2 * sms, batch_size * num_kv_heads)
    return max(1, min(want, MAX_SPLITS, triton.cdiv(max_context, block_n)))


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    table_idx: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    new_kv: NewKV | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per request over its cached keys [0, seq_lens[b]), or with a
    sliding `window` over the last `window` of them.

    q: [B, Hq, D]; k_pool, v_pool: [slots, Hk, D] (last dim contiguous); page_table: [rows, max_len]
    int32; table_idx, seq_lens: [B] int32 on the device. Returns [B, Hq, D] in q's dtype.
    `num_splits` defaults to `choose_num_splits` from static sizes (see the module docstring).
    An fp8 pool (float8_e4m3fn) comes with k_scale, v_scale: [Hk] float32, a stored value being
    the real one divided by its head's scale (KVPool's format).
    With `new_kv`, q is not yet normalised or rotated and the pool does not yet hold position
    seq_lens[b] - 1: the kernel does rope_store's work first (one launch fewer per layer).
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num q heads {num_heads} is not a multiple of num kv heads {num_kv_heads}")
    assert q.stride(-1) == 1 and k_pool.stride(-1) == 1 and v_pool.stride(-1) == 1
    assert page_table.stride(-1) == 1
    group = num_heads // num_kv_heads
    fp8_pool = k_pool.element_size() == 1
    block_n = FP8_BLOCK_N if k_scale is not None else BLOCK_N
    if num_splits is None:
        longest = min(page_table.shape[1], window or page_table.shape[1])
        num_splits = choose_num_splits(batch, num_kv_heads, longest, q.device, block_n)
    if out is None:
        out = torch.empty_like(q)
    block_d = triton.next_power_of_2(head_dim)
    if num_splits > 1:
        part_out = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused: pass 1 writes the output itself
    if batch == 0:
        return out
    prologue, prologue_strides = decode_prologue_args(new_kv, q, seq_lens)
    widen = k_scale is not None and FP8_PTX_WIDEN and ptx_widens_e4m3(q.device)
    launch = {"num_warps": NUM_WARPS, "num_stages": FP8_WIDENED_STAGES if widen else NUM_STAGES}
    if k_scale is not None and not widen and FP8_MAX_REGISTERS:
        launch["maxnreg"] = FP8_MAX_REGISTERS
    decode_split_kernel[(num_kv_heads, batch, num_splits)](
        q,
        k_pool,
        v_pool,
        out,
        part_out,
        part_lse,
        page_table,
        table_idx,
        seq_lens,
        k_scale if k_scale is not None else seq_lens,
        v_scale if v_scale is not None else seq_lens,
        *prologue,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        *prologue_strides,
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        out.stride(0),
        out.stride(1),
        page_table.stride(0),
        num_splits,
        GROUP=group,
        HEAD_DIM=head_dim,
        DIRECT_OUT=num_splits == 1,
        KV_SCALED=k_scale is not None,
        NEW_KV=new_kv is not None,
        HAS_NORM=new_kv is not None and new_kv.q_norm_weight is not None,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        WINDOW=window or 0,
        PREFETCH=attention_chained(batch, fp8_pool),
        LINES=triton.next_power_of_2(triton.cdiv(head_dim * k_pool.element_size(), CACHE_LINE)),
        LINE_ELEMENTS=CACHE_LINE // k_pool.element_size(),
        V_PTX_WIDEN=widen,
        **launch,
        **attention_pdl_args(q.device, batch, fp8_pool),
    )
    if num_splits > 1:
        merge_splits(out, part_out, part_lse)
    return out
