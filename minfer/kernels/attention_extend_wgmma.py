"""Long-prompt extend attention for Hopper, written in Gluon: warp-specialized, and the softmax of
one key block runs while the tensor cores multiply the previous block's probabilities by V.

Why a second extend kernel: a long prompt's chunks are compute-bound, and the Triton kernel
(attention_extend.py) reaches 54% of the tensor cores' rate there: in one of its programs each
key block's QK^T, softmax and PV run one after another (Triton waits for a tensor-core product
where it is issued). Here a program has three warpgroups:

- a producer fills rings of STAGES slots with each key block's K and V rows, K and V apart: a
  K slot is free again once both consumers' scores are done with it, before their PV products
  end. A block whose pool slots are consecutive (with pages of 1, as the allocator hands a
  prompt its slots, in ascending runs; or pages of BLOCK_N or more) is one TMA box, a bulk copy
  that costs no thread an instruction per row; other blocks are gathered row by row through
  the page table with cp.async. Block i + 1's page-table entries are loaded while block i is
  copied and reach the copy layout through shared memory, so no L2 round trip stands before a
  block's copies;
- two consumers (attention_extend_wgmma_consumer) own 64 query rows each, with Q in registers
  as the scores' left operand (so a key block crosses shared memory once per consumer). Per
  block j a consumer issues block j's scores and block j - 1's PV product, waits for the
  scores only, and runs block j's softmax while PV is in flight (FlashAttention-3's overlap
  within a warpgroup); the consumers run at their own pace, with no barrier between them.
  The softmax's running sums are products too (each block's P times a column of ones, beside
  PV), and the running max moves only when some row grew by more than 2^8, so most blocks skip
  the accumulators' rescale (FlashAttention-4's conditional rescale).

Registers are moved to the consumers (setmaxnreg: 240 each, the producer 32).

Measured on an H100 (docs/BENCHMARKS.md, twenty-seventh to thirtieth sessions, with the
variants that did not pay): an 8k chunk over a 16k prefix (Llama-8B heads) at 634 TFLOP/s with
every block one box, ~470 with every block gathered, against the Triton kernel's 434, at the
boost clock; under sustained load the card's power cap takes ~13% off (559 TFLOP/s, thirty-
second session).

Scope: the engine's long launches only (attention_extend.launch_config's LONG_CONFIG case):
bf16 or fp16 pools with 128-dim heads, no sliding window, compute capability 9.x (wgmma and
setmaxnreg). The Triton kernel serves everything else, and on the CPU this file is never
compiled. A launch that raises (Gluon is experimental and changes between Triton releases; this
was written for 3.6) turns the kernel off with one warning, and the Triton kernel takes over.
"""

from __future__ import annotations

import functools
import logging

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from minfer.kernels.attention_extend_wgmma_consumer import LOAD, TILE, _consumer

log = logging.getLogger(__name__)
LOG2E = 1.4426950408889634
# (BLOCK_M, BLOCK_N, STAGES): 128 query rows (two consumers of 64), 128-key blocks, 3 ring slots
# of K and of V (32 KB each) besides the Q tile (32 KB, also O's way out): 225 KB, one program
# an SM. 128-key blocks beat 64-key ones (5 slots) by 3-5%: half the row reductions and
# rescales per key. BLOCK_M must equal attention_extend.LONG_CONFIG's (the tile maps' size).
CONFIG = (128, 128, 3)
CONSUMER_REGS = 240  # per thread; 2 x 128 x 240 + 128 x 32 fills the 64K-register file
PRODUCER_REGS = 32
COPY_ROWS = gl.constexpr(32)  # rows of a block one cp.async copy covers: few pointers live at once
PRODUCER_THREADS = 128  # one warpgroup: every thread's copies arrive on a `full` barrier
# The launch's register limit, per thread over all 12 warps; setmaxnreg then moves registers.
MAXNREG = (2 * CONSUMER_REGS + PRODUCER_REGS) // 3 // 8 * 8


_disabled: str | None = None  # why the kernel is off, once a launch of it raised (see the docstring)


@functools.cache
def supported(device: torch.device) -> bool:
    """Whether this kernel can run on `device`: Hopper (wgmma is sm_90 only)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def applies(q: torch.Tensor, k_pool: torch.Tensor, window: int | None) -> bool:
    """Whether a long launch over these tensors can take this kernel."""
    return (
        _disabled is None
        and window is None
        and q.shape[-1] == 128
        and q.dtype in (torch.bfloat16, torch.float16)
        and k_pool.dtype == q.dtype
        and k_pool.stride(2) == 1
        and k_pool.stride(1) == q.shape[-1]  # a slot's heads side by side: the TMA descriptors' view
        and supported(q.device)
    )


@gluon.jit
def _producer(
    half, q_ptr, out_ptr, q_start, extend_len, block_m, head, prefix, stride_qt, stride_qh,
    stride_ot, stride_oh, page_row, k_head, v_head, stride_ks, stride_vs, end, unmasked_end,
    num_blocks, sm_scale_log2, q_staging, k_buf, v_buf, full, empty, slot_buf, k_desc, v_desc,
    kv_col, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
):  # fmt: skip
    """The producer warpgroup: every key block's K and V rows into ring slot block % STAGES,
    once both consumers have read what the slot held before."""
    # Every warp holds all of a block's page-table entries, so the run check's reductions stay
    # within a warp (shuffles; across warps they would cost shared memory and barriers).
    EVERY_WARP: gl.constexpr = gl.BlockedLayout([BLOCK_N // 32], [32], [4], [0])
    rows = gl.arange(0, COPY_ROWS, layout=gl.SliceLayout(1, LOAD))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LOAD))
    offs_n = gl.arange(0, BLOCK_N, layout=EVERY_WARP)
    entries = gl.load(page_row + offs_n, mask=offs_n < end, other=0)
    slot_buf.index(0).store(entries)
    run = _run_start(entries, 0, end, offs_n)
    gl.thread_barrier()
    for i in range(num_blocks):
        slot = i % STAGES
        phase = ((i // STAGES) & 1) ^ 1  # a fresh mbarrier counts its phase before 0 as complete
        next_pos = (i + 1) * BLOCK_N + offs_n
        next_slots = gl.load(page_row + next_pos, mask=next_pos < end, other=0)  # in flight meanwhile
        slots = slot_buf.index(i % 2)
        mbarrier.wait(empty.index(slot), phase)
        _fill(k_buf.index(slot), k_desc, full.index(slot), k_head, stride_ks, kv_col, slots, run,
              i * BLOCK_N, rows, offs_d, end, BLOCK_N)  # fmt: skip
        mbarrier.wait(empty.index(STAGES + slot), phase)
        _fill(v_buf.index(slot), v_desc, full.index(STAGES + slot), v_head, stride_vs, kv_col, slots,
              run, i * BLOCK_N, rows, offs_d, end, BLOCK_N)  # fmt: skip
        slot_buf.index((i + 1) % 2).store(next_slots)
        run = _run_start(next_slots, (i + 1) * BLOCK_N, end, offs_n)
        gl.thread_barrier()  # every thread's entries, before any thread reads them


@gluon.jit
def _run_start(entries, first, end, offs_n):
    """The pool slot a key block's rows start at if their slots are consecutive and all of them
    are keys (one TMA box then copies the block), else -1."""
    step = entries - offs_n  # the same value for every row iff the slots are consecutive
    low = gl.min(step, 0)
    whole = first + entries.numel <= end
    return gl.where((low == gl.max(step, 0)) & whole, low, -1)


@gluon.jit
def _fill(
    buf, desc, bar, head_ptr, stride, col, slots, start, first, rows, offs_d, end, BLOCK_N: gl.constexpr
):
    """A key block's K (or V) rows into ring slot `buf`: one TMA box when the block's pool slots
    are consecutive (`start` >= 0; a copy engine moves it, with no instructions per row), else
    gathered row by row with cp.async. Either way `bar` sees one arrival per producer thread."""
    if start >= 0:
        mbarrier.expect(bar, BLOCK_N * desc.block_type.shape[1] * 2)  # an arrival, and bf16/fp16 bytes
        tma.async_copy_global_to_shared(desc, [start, col], bar, buf)
        # (expect and arrive run on one elected thread: the other producer threads' arrivals)
        mbarrier.arrive(bar, count=gl.num_warps() * 32 - 1)
    else:  # no arrival beyond the threads' own, so no barrier around one: the gather as before TMA
        for r in gl.static_range(0, BLOCK_N, COPY_ROWS):
            _copy_rows(buf.slice(r, COPY_ROWS), head_ptr, stride, slots.slice(r, COPY_ROWS), first + r,
                       rows, offs_d, end)  # fmt: skip
        async_copy.mbarrier_arrive(bar, increment_count=False)  # once this thread's copies have landed


@gluon.jit
def _copy_rows(buf, head_ptr, stride, slots, first, rows, offs_d, end):
    """COPY_ROWS key rows from position `first` on into buf by their page-table entries `slots`
    (rows past the keys: zeros)."""
    entries = slots.load(gl.SliceLayout(1, LOAD)).to(gl.int64)[:, None]
    src = head_ptr + entries * stride + offs_d[None, :]
    async_copy.async_copy_global_to_shared(buf, src, mask=(first + rows < end)[:, None])


@gluon.jit
def _extend_wgmma_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, out_ptr, page_table_ptr, table_idx_ptr, prefix_lens_ptr, seq_lens_ptr,
    cu_extend_lens_ptr, tiles_ptr, sm_scale_log2, stride_qt, stride_qh, stride_ks, stride_kh,
    stride_vs, stride_vh, stride_ot, stride_oh, stride_page_row, stride_tiles,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, HEAVY_FIRST: gl.constexpr, TILED: gl.constexpr,
    PRODUCER_THREADS: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):  # fmt: skip
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
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        q_staging = gl.allocate_shared_memory(dtype, [2, BLOCK_M // 2, HEAD_DIM], TILE)
        k_buf = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], TILE)
        v_buf = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], TILE)
        # K's ring barriers, then V's; the page-table entries of two blocks
        full = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
        slot_buf = gl.allocate_shared_memory(gl.int32, [2, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        for i in gl.static_range(2 * STAGES):
            mbarrier.init(full.index(i), count=PRODUCER_THREADS)  # see _fill
            mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup

        page_row = page_table_ptr + row * stride_page_row
        kv_col = (head // GROUP) * HEAD_DIM  # the head's first column in the descriptors' view
        k_head = k_ptr + (head // GROUP) * stride_kh
        v_head = v_ptr + (head // GROUP) * stride_vh
        # Keys [0, end): the last row's position bounds them. Blocks from unmasked_end on reach
        # the tile's own positions and take the causal mask.
        end = gl.minimum(seq_len, prefix + (block_m + 1) * BLOCK_M)
        unmasked_end = (prefix + block_m * BLOCK_M) // BLOCK_N * BLOCK_N
        num_blocks = gl.cdiv(end, BLOCK_N)
        # Every partition takes the same arguments (Gluon requires it); `half` and Q's are the consumers'.
        gl.warp_specialize(
            [
                (_consumer, (0, q_ptr, out_ptr, q_start, extend_len, block_m, head, prefix, stride_qt,
                    stride_qh, stride_ot, stride_oh, page_row, k_head, v_head, stride_ks, stride_vs, end,
                    unmasked_end, num_blocks, sm_scale_log2, q_staging.index(0), k_buf, v_buf, full,
                    empty, slot_buf, k_desc, v_desc, kv_col, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES)),
                (_consumer, (1, q_ptr, out_ptr, q_start, extend_len, block_m, head, prefix, stride_qt,
                    stride_qh, stride_ot, stride_oh, page_row, k_head, v_head, stride_ks, stride_vs, end,
                    unmasked_end, num_blocks, sm_scale_log2, q_staging.index(1), k_buf, v_buf, full,
                    empty, slot_buf, k_desc, v_desc, kv_col, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES)),
                (_producer, (2, q_ptr, out_ptr, q_start, extend_len, block_m, head, prefix, stride_qt,
                    stride_qh, stride_ot, stride_oh, page_row, k_head, v_head, stride_ks, stride_vs, end,
                    unmasked_end, num_blocks, sm_scale_log2, q_staging.index(0), k_buf, v_buf, full,
                    empty, slot_buf, k_desc, v_desc, kv_col, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES)),
            ],
            [4, PRODUCER_THREADS // 32],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip


def _block_descriptor(pool: torch.Tensor, block_n: int) -> TensorDescriptor:
    """A TMA descriptor over a K or V pool seen as [slots, kv heads x head dim], whose box is a
    key block's rows (block_n consecutive slots) of one head."""
    slots, kv_heads, head_dim = pool.shape  # (`applies` checked that a slot's heads are contiguous)
    return TensorDescriptor(
        pool, [slots, kv_heads * head_dim], [pool.stride(0), 1], [block_n, head_dim], TILE.value
    )


def extend_attention_wgmma(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor,
    page_table: torch.Tensor, table_idx: torch.Tensor, prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor, cu_extend_lens: torch.Tensor, scale: float,
    tiles: torch.Tensor | None, grid: tuple[int, ...], heavy_first: bool,
) -> bool:  # fmt: skip
    """attention_extend.extend_attention's long launch on this kernel (arguments and grid as
    there, which CONFIG's BLOCK_M must have sized; `applies` must hold). Writes `out` and
    returns True; False, with this kernel disabled from then on, when the launch raised (the
    caller then runs the Triton kernel)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_m, block_n, stages = CONFIG
    try:  # a compile or launch error is raised here, before any work runs
        k_desc, v_desc = _block_descriptor(k_pool, block_n), _block_descriptor(v_pool, block_n)
        _extend_wgmma_kernel[grid](
            q, k_pool, v_pool, k_desc, v_desc, out, page_table, table_idx, prefix_lens, seq_lens, cu_extend_lens,
            tiles if tiles is not None else seq_lens, scale * LOG2E, q.stride(0), q.stride(1),
            k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), out.stride(0),
            out.stride(1), page_table.stride(0), tiles.stride(0) if tiles is not None else 16,
            GROUP=num_heads // k_pool.shape[1], HEAD_DIM=head_dim, BLOCK_M=block_m,
            BLOCK_N=block_n, STAGES=stages, HEAVY_FIRST=heavy_first, TILED=tiles is not None,
            PRODUCER_THREADS=PRODUCER_THREADS, CONSUMER_REGS=CONSUMER_REGS,
            PRODUCER_REGS=PRODUCER_REGS, maxnreg=MAXNREG,
            num_warps=4,  # the first consumer; the other two warpgroups come with warp_specialize
        )  # fmt: skip
    except Exception as e:
        global _disabled
        _disabled = f"{type(e).__name__}: {e}"
        log.warning("the Gluon extend kernel failed (%s); long prefills use the Triton kernel", _disabled)
        return False
    return True
