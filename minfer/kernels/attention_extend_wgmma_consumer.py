"""The consumer warpgroups of the Gluon long-extend kernel (attention_extend_wgmma, whose
docstring tells the design): a consumer owns 64 query rows and, per key block, issues the block's
scores and the previous block's PV product on the tensor cores, then runs the block's online
softmax while PV is in flight. Also the two layouts both sides of the kernel's rings use."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# Q, K/V tiles in shared memory: the layout wgmma reads, and TMA writes (rows of 128 bytes swizzled)
TILE = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
# Q, K/V and out tiles in registers: 16 bytes per thread along the head dim.
LOAD = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))
# The running sums' columns of ones (see _consumer): the narrowest product the tensor cores take
# with rows of 32 bytes, a swizzle wgmma reads.
SUM_COLS = gl.constexpr(16)
ONES_TILE = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2))


# The running max moves only when some row's max grew by more than 2^RESCALE_LOG2; until then
# probabilities may reach 2^8 (fp32 sums and bf16 P hold that), and the output is the same:
# numerator and denominator share the max they were taken against.
RESCALE_LOG2 = gl.constexpr(8.0)


@gluon.jit
def _online_softmax(s, m_i, sm_scale_log2):
    """One block's step of the online softmax over raw scores s (base 2, scaled here): the
    running max, the factor for what was accumulated before, the block's probabilities, and
    whether the max moved (else the factor is 1 and the accumulators need no rescale: 64
    multiplies per thread a block saved, most blocks once the first few set the max). (The
    running sum is the tensor cores': see _consumer.)"""
    m_block = gl.max(s, 1)
    moved = gl.max((m_block - m_i) * sm_scale_log2, 0) > RESCALE_LOG2
    if moved:  # noqa: SIM108  (a branch on a scalar, as measured and tested on the GPU)
        m_new = gl.maximum(m_i, m_block)
    else:
        m_new = m_i
    m_scaled = m_new * sm_scale_log2
    alpha = gl.exp2(m_i * sm_scale_log2 - m_scaled)
    p = gl.exp2(s * sm_scale_log2 - m_scaled[:, None])
    return m_new, alpha, p, moved


@gluon.jit
def _attend_block(
    j, q_operand, k_buf, v_buf, ones, full, empty, p_prev, acc, m_i, sums, zeros, unmasked_end,
    q_pos, key_offs, sm_scale_log2, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
    P_OPERAND: gl.constexpr, O_MMA: gl.constexpr, SUM_MMA: gl.constexpr,
):  # fmt: skip
    """A consumer's block j >= 1: block j's scores and block j - 1's PV product (probabilities
    p_prev) are issued, and block j's softmax runs while PV is in flight. Returns block j's
    probabilities (the next PV operand) and the updated state. Barriers: full/empty[slot] are
    K's, full/empty[STAGES + slot] V's."""
    slot = j % STAGES
    v_slot = (j - 1) % STAGES
    # V_{j-1} was copied before K_j, so waiting for it first costs nothing; waiting between the
    # two issues would put a loop (and ptxas's wgmma wait) between them.
    mbarrier.wait(full.index(STAGES + v_slot), ((j - 1) // STAGES) & 1)
    mbarrier.wait(full.index(slot), (j // STAGES) & 1)
    fence_async_shared()  # the copies' writes, before the tensor cores read them
    s_token = warpgroup_mma(q_operand, k_buf.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
    acc_token = warpgroup_mma(p_prev, v_buf.index(v_slot), acc, is_async=True)
    sums_token = warpgroup_mma(p_prev, ones, sums, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s_token,))
    mbarrier.arrive(empty.index(slot))  # K_j is read
    # The softmax sits inside the branches: ptxas puts a wgmma wait at the top of its basic
    # block, so the wait for PV below (in the join block) then comes after the exps it should
    # overlap, rather than before them (seen in the sm_90 code).
    if j * BLOCK_N >= unmasked_end:  # a block that reaches the rows' own positions
        s = gl.where(key_offs[None, :] <= (q_pos - j * BLOCK_N)[:, None], s, float("-inf"))
        m_new, alpha, p, moved = _online_softmax(s, m_i, sm_scale_log2)
    else:
        m_new, alpha, p, moved = _online_softmax(s, m_i, sm_scale_log2)
    acc, sums, p_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc_token, sums_token, p_prev))
    mbarrier.arrive(empty.index(STAGES + v_slot))  # V_{j-1} is read
    if moved:
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_MMA))[:, None]
        sums = sums * gl.convert_layout(alpha, gl.SliceLayout(1, SUM_MMA))[:, None]
    p_next = gl.convert_layout(p.to(p_prev.dtype), P_OPERAND)
    return p_next, acc, m_new, sums


@gluon.jit
def _consumer(
    half, q_ptr, out_ptr, q_start, extend_len, block_m, head, prefix, stride_qt, stride_qh,
    stride_ot, stride_oh, page_row, k_head, v_head, stride_ks, stride_vs, end, unmasked_end,
    num_blocks, sm_scale_log2, q_staging, k_buf, v_buf, full, empty, slot_buf, k_desc, v_desc,
    kv_col, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
):  # fmt: skip
    """One consumer warpgroup: query rows [half * 64, half * 64 + 64) of the program's tile
    over every key block, written to out."""
    ROWS: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    # Products: each warp owns 16 rows, so row reductions stay within a warp.
    S_MMA: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [4, 1], instr_shape=[16, BLOCK_N, 16])
    O_MMA: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [4, 1], instr_shape=[16, HEAD_DIM, 16])
    P_OPERAND: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_MMA, k_width=2)
    # The softmax's running sums: each block's probabilities times a column of ones, on the
    # tensor cores with its PV product (every column of `sums` holds the row's sum). A sum by
    # the consumers' own instructions costs one add per score, and their instruction stream is
    # what bounds the kernel (docs/PERFORMANCE.md section 31).
    SUM_MMA: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [4, 1], instr_shape=[16, SUM_COLS, 16])

    first_row = block_m * BLOCK_M + half * ROWS
    offs_m = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, LOAD))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LOAD))
    m_mask = offs_m < extend_len
    q_rows = (q_start + offs_m).to(gl.int64)
    q_tile = q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = gl.load(q_tile, mask=m_mask[:, None], other=0.0)
    # Q into the registers of the scores' left operand, through shared memory.
    q_staging.store(q)
    gl.thread_barrier()
    q_operand = q_staging.load(gl.DotOperandLayout(operand_index=0, parent=S_MMA, k_width=2))
    # The ones the running sums are products with, in the Q tile while Q is in registers (the
    # kernel's shared memory is full).
    ones = q_staging._reinterpret(dtype, [BLOCK_N, SUM_COLS], ONES_TILE)
    gl.thread_barrier()  # every warp's Q is loaded
    ones.store(gl.full([BLOCK_N, SUM_COLS], 1.0, dtype, LOAD))
    fence_async_shared()
    gl.thread_barrier()
    q_pos = prefix + first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, S_MMA))
    key_offs = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_MMA))
    zeros = gl.zeros([ROWS, BLOCK_N], gl.float32, S_MMA)

    # Block 0: scores and softmax; its PV product is issued with block 1's scores.
    mbarrier.wait(full.index(0), 0)
    fence_async_shared()
    s = warpgroup_mma(q_operand, k_buf.index(0).permute((1, 0)), zeros, use_acc=False)
    mbarrier.arrive(empty.index(0))
    if unmasked_end == 0:
        s = gl.where(key_offs[None, :] <= q_pos[:, None], s, float("-inf"))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, S_MMA))
    m_i, _, p, _ = _online_softmax(s, m_i, sm_scale_log2)
    p_a = gl.convert_layout(p.to(dtype), P_OPERAND)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, O_MMA)
    sums = gl.zeros([ROWS, SUM_COLS], gl.float32, SUM_MMA)
    # Two blocks per trip: the probabilities being written (p_b, then p_a) are another value
    # than those the PV product in flight reads, where one p carried around the loop ties them
    # together. Measured (without warp specialization): 466 TFLOP/s against 427 with one.
    for pair in range(0, (num_blocks - 1) // 2):
        j = 1 + 2 * pair
        p_b, acc, m_i, sums = _attend_block(
            j, q_operand, k_buf, v_buf, ones, full, empty, p_a, acc, m_i, sums, zeros, unmasked_end,
            q_pos, key_offs, sm_scale_log2, STAGES, BLOCK_N, P_OPERAND, O_MMA, SUM_MMA,
        )  # fmt: skip
        p_a, acc, m_i, sums = _attend_block(
            j + 1, q_operand, k_buf, v_buf, ones, full, empty, p_b, acc, m_i, sums, zeros, unmasked_end,
            q_pos, key_offs, sm_scale_log2, STAGES, BLOCK_N, P_OPERAND, O_MMA, SUM_MMA,
        )  # fmt: skip
    if (num_blocks - 1) % 2 == 1:
        p_a, acc, m_i, sums = _attend_block(
            num_blocks - 1, q_operand, k_buf, v_buf, ones, full, empty, p_a, acc, m_i, sums, zeros,
            unmasked_end, q_pos, key_offs, sm_scale_log2, STAGES, BLOCK_N, P_OPERAND, O_MMA, SUM_MMA,
        )  # fmt: skip
    # The last block's PV product (the producer is done: no slot needs freeing).
    last = num_blocks - 1
    mbarrier.wait(full.index(STAGES + last % STAGES), (last // STAGES) & 1)
    fence_async_shared()
    acc_token = warpgroup_mma(p_a, v_buf.index(last % STAGES), acc, is_async=True)
    sums_token = warpgroup_mma(p_a, ones, sums, is_async=True)
    acc, sums = warpgroup_mma_wait(num_outstanding=0, deps=(acc_token, sums_token))

    o = acc / gl.convert_layout(gl.max(sums, 1), gl.SliceLayout(1, O_MMA))[:, None]
    # Out through the Q tile, free now (every warp is past the last product reading the ones):
    # a layout conversion would need 16 KB of shared memory.
    gl.thread_barrier()
    q_staging.store(o.to(out_ptr.dtype.element_ty))
    gl.thread_barrier()
    out_tile = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    gl.store(out_tile, q_staging.load(LOAD), mask=m_mask[:, None])
