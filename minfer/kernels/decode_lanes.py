"""Decode attention's key loop on CUDA cores, for an fp8 pool and small GQA groups.

Why not tensor cores there: a decode program multiplies a handful of query rows (the GQA group,
2 for Qwen3-0.6B, 4 for Llama-3.1-8B) with each key block, so `tl.dot` pads the group to 16
rows and, worse for an fp8 pool, needs V in the MMA's operand layout: Triton has no 8-bit
transposing ldmatrix and reads V's bytes out of shared memory one at a time (128 byte loads
per thread per 128-key block, docs/PERFORMANCE.md section 14), which held the fp8 kernel at
~2.8 TB/s against the 4.26 TB/s copy ceiling. Here K and V go from global memory straight to
registers, are widened to fp32 there, and every product is an FMA.

The layout that keeps the loop free of cross-warp traffic: a key block of LANES x DEPTH keys
is a [DEPTH, LANES, D] tile, key `j * LANES + r` at [j, r]. Each of the LANES lanes runs its own
online softmax over keys r, r + LANES, ... (a running max, sum and accumulator per lane and
query row), so the loop reduces only over D (a few warp shuffles for the scores) and over DEPTH
(inside a thread). The lanes are merged once, by their log-sum-exp, after the loop.
"""

from __future__ import annotations

import triton
import triton.language as tl

# A running max that starts finite: a lane that has seen no key yet (masked positions score
# -inf) then rescales by exp2(0) = 1 instead of exp2(-inf - -inf) = NaN, and weighs 0 at the merge.
NO_KEY_YET = tl.constexpr(-1.0e30)


@triton.jit
def attend_lanes(
    q,
    page_row,
    k_head,
    v_head,
    stride_ks,
    stride_vs,
    start,
    end,
    sm_scale_log2,
    offs_d,
    d_mask,
    LANES: tl.constexpr,
    DEPTH: tl.constexpr,
):
    """Softmax attention of q's rows ([BLOCK_H, BLOCK_D], any float dtype) over keys
    [start, end) gathered through a page-table row: returns (max, sum, unnormalised output)
    over all keys, base 2, as attend_blocks does. K/V are widened to fp32; an fp8 pool's
    scales are the caller's (scores and output), as with attend_blocks."""
    offs_j = tl.arange(0, DEPTH)
    offs_r = tl.arange(0, LANES)
    block_keys = offs_j[:, None] * LANES + offs_r[None, :]  # [DEPTH, LANES]
    q4 = q.to(tl.float32)[:, None, None, :]  # [H, 1, 1, D]
    dims = offs_d[None, None, :]
    m = tl.full([q.shape[0], LANES], NO_KEY_YET, tl.float32)
    l_sum = tl.zeros([q.shape[0], LANES], tl.float32)
    acc = tl.zeros([q.shape[0], LANES, q.shape[1]], tl.float32)
    for n0 in range(start, end, LANES * DEPTH):
        pos = n0 + block_keys
        n_mask = pos < end
        slots = tl.load(page_row + pos, mask=n_mask, other=0).to(tl.int64)[:, :, None]
        kv_mask = n_mask[:, :, None] & d_mask[None, None, :]
        k = tl.load(k_head + slots * stride_ks + dims, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q4 * k[None, :, :, :], 3) * sm_scale_log2  # [H, DEPTH, LANES]
        scores = tl.where(n_mask[None, :, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None, :])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_head + slots * stride_vs + dims, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, :, None] + tl.sum(p[:, :, :, None] * v[None, :, :, :], 1)
        m = m_new
    # merge the lanes: weights relative to each row's overall max (a lane that saw no key has
    # max NO_KEY_YET and sum 0, so it weighs 0)
    m_all = tl.max(m, 1)
    w = tl.exp2(m - m_all[:, None])
    return m_all, tl.sum(l_sum * w, 1), tl.sum(acc * w[:, :, None], 1)
