"""Small-batch GEMM in Triton: y = x @ w.T (+ bias) for decode steps (few rows, small weights).

Why not cuBLAS here: with a handful of token rows the product is a read of the weights, and
a decode step of a small model is dozens of such reads of a few MB each. cuBLAS launches few
programs for narrow outputs (Qwen3-0.6B's o_proj at one row: 12.6 us for 4 MB, a 1 us read)
and its fixed cost per call dominates. This kernel splits K as well, so about one program per
SM reads a slice of the weights (o_proj at one row: 5.0 us). Where it is used is set by
`suits`: measured on an H200 (docs/BENCHMARKS.md), it wins or ties up to 64 rows on Qwen3-0.6B's
weights and loses to cuBLAS's larger tensor-core tiles beyond. One- and two-row products go to
minfer.kernels.gemv first (layers/linear.py), which beats this kernel there.

How the splits are summed without a second kernel (which would cost a graph node and its
launch gap per GEMM): each program writes its fp32 partial tile to a workspace, then bumps the
tile's arrival counter. The program that arrives last adds all partials of the tile in split
order (0, 1, ...), so the result does not depend on which program finished first, writes the
output and resets the counter to zero for the next launch. The counters live in one zeroed
buffer per device; GEMMs on one stream run one after another, so they never share a counter
while it is non-zero.

Launched early in a chain of kernels (pdl.pdl_args, for the rows MINFER_CHAIN_BANDS names),
each program asks L2 for its weight slice before it waits for the kernel before it.

Rows of x may be strided (views of a larger activation); the last dim must be contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minfer.kernels.common import CACHE_LINE, arrival_counters, dot, matmul_operands, num_sms, prefetch_l2
from minfer.kernels.pdl import pdl_args, pdl_start

# Where this kernel was measured to match or beat cuBLAS on an H200 (scripts/gpu_check.py
# --gemm): up to 64 rows, weights up to Qwen3-0.6B's largest (gate_up, 6144 x 1024), and
# Qwen3-30B-A3B's o_proj (2048 x 4096), where cuBLAS picks a split-K GEMM plus a separate
# reduction (batch-1 decode 3.99 -> 3.93 ms per step through this kernel). Llama-8B's weights
# (16M+ elements) stream at close to bandwidth in cuBLAS, and more rows want cuBLAS's bigger
# tensor-core tiles; Qwen3-30B-A3B's qkv (5120 x 2048) was no faster here.
MAX_ROWS = 64
MAX_WEIGHT_ELEMENTS = 4096 * 2048
_MAX_TILES = 4096  # arrival counters per device: one per output tile of a split launch
# A program walks its K slice one block after another, with only `num_stages` loads in flight,
# so a long slice is bound by memory latency, not bandwidth. Measured on an H200 at one row
# (scripts/gpu_check.py --gemm-sweep): Qwen3-30B-A3B's o_proj (K = 4096) took 9.2 us with 2
# splits of 2048 and 7.9 us with 4 splits of 1024; slices of 1024 or less were never slower.
MAX_K_PER_SPLIT = 1024


@triton.jit
def _gemm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    k_per_split,
    num_splits,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL_RELEASE: tl.constexpr,
    PDL_WAIT: tl.constexpr,
    SLICE_LINES: tl.constexpr,
    LINE_ELEMENTS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N

    k_start = split * k_per_split
    if PDL_WAIT:  # launched early: ask L2 for this program's weight slice while the kernel before runs
        k_end = tl.minimum(k_start + k_per_split, K)
        prefetch_weight_slice(w_ptr, stride_wn, offs_n, n_mask, k_start, k_end, SLICE_LINES, LINE_ELEMENTS)
    pdl_start(PDL_RELEASE, PDL_WAIT)  # x and the partials are the previous kernels' from here
    x_tile = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_start + offs_k)[None, :]
    w_tile = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (k_start + offs_k)[:, None]  # [K, N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in tl.range(0, k_per_split, BLOCK_K):
        k_mask = k_start + k + offs_k < K
        x = tl.load(x_tile + k, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_tile + k, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += dot(x, w)

    store_tile(
        acc,
        out_ptr,
        bias_ptr,
        partial_ptr,
        counter_ptr,
        offs_m,
        offs_n,
        M,
        N,
        stride_om,
        split,
        num_splits,
        SPLIT,
        HAS_BIAS,
    )


@triton.jit
def prefetch_weight_slice(
    w_ptr, stride_wn, offs_n, n_mask, k_start, k_end, SLICE_LINES: tl.constexpr, LINE_ELEMENTS: tl.constexpr
):
    """Ask L2 for weight rows `offs_n`, columns [k_start, k_end): one address per cache line
    (`split_workspace`'s SLICE_LINES and LINE_ELEMENTS)."""
    offs_line = k_start + tl.arange(0, SLICE_LINES) * LINE_ELEMENTS
    lines = n_mask[:, None] & (offs_line < k_end)[None, :]
    prefetch_l2(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_line[None, :], lines)


@triton.jit
def store_tile(
    acc,
    out_ptr,
    bias_ptr,
    partial_ptr,
    counter_ptr,
    offs_m,
    offs_n,
    M,
    N,
    stride_om,
    split,
    num_splits,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """Write a program's fp32 tile `acc` of out [M, N] (grid: N tiles, M tiles, K splits). Split
    launches write their partial and count arrivals; the last program to arrive sums the tile's
    partials in split order, adds the bias and stores (see the module docstring)."""
    out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    n_mask = offs_n < N
    if SPLIT:
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        # partials: [num_splits, M, N] fp32
        part = partial_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(part + split.to(tl.int64) * M * N, acc, mask=out_mask)
        # Every thread's partial store must precede the arrival (release) that publishes it.
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            acc = tl.zeros_like(acc)
            for _ in range(num_splits):  # fixed order: the sum is the same whoever arrives last
                acc += tl.load(part, mask=out_mask, other=0.0, cache_modifier=".cg")
                part += M * N
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(
                out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                acc.to(out_ptr.dtype.element_ty),
                mask=out_mask,
            )
            tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )


def choose_config(m: int, n: int, k: int, num_sms: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) for an [m, k] x [k, n] GEMM.

    Tiles as tall as the batch (at least 16, the smallest tensor-core tile) and 32 wide; then
    enough K splits that the launch has about one program per SM, and more if a slice would be
    longer than MAX_K_PER_SPLIT (up to two programs per SM), each still looping over at least
    two K blocks.
    """
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    block_n = 32
    block_k = 128 if k >= 256 else max(16, triton.next_power_of_2(k))
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, block_k)
    short_slices = min(triton.cdiv(k, MAX_K_PER_SPLIT), 2 * num_sms // tiles)  # <= 2 programs per SM
    split_k = max(1, min(max(num_sms // tiles, short_slices), k_blocks // 2))
    if tiles > _MAX_TILES:
        split_k = 1
    return block_m, block_n, block_k, split_k, 4, 4


def split_workspace(
    out: torch.Tensor, weight: torch.Tensor, block_k: int, split_k: int
) -> tuple[int, int, torch.Tensor, torch.Tensor, dict]:
    """For a launch into out [M, N] with `split_k` K splits of whole `block_k` blocks: the K per
    split, the splits left after rounding, the fp32 partials [splits, M, N] (out itself when
    unsplit), the arrival counters, and the weight-slice prefetch's constants."""
    k = weight.shape[1]
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)  # rounding K up to whole blocks may leave fewer splits
    m, n = out.shape
    partials = torch.empty((split_k, m, n), dtype=torch.float32, device=out.device) if split_k > 1 else out
    line_elements = CACHE_LINE // weight.element_size()
    prefetch = {
        "SLICE_LINES": triton.next_power_of_2(triton.cdiv(k_per_split, line_elements)),
        "LINE_ELEMENTS": line_elements,
    }
    return k_per_split, split_k, partials, arrival_counters(out.device, "gemm", _MAX_TILES), prefetch


def suits(rows: int, weight: torch.Tensor) -> bool:
    """Whether `linear` should take this GEMM rather than cuBLAS (see MAX_ROWS)."""
    return rows <= MAX_ROWS and weight.numel() <= MAX_WEIGHT_ELEMENTS


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias[N]) -> [..., N] in x's dtype, accumulated in fp32."""
    n, k = weight.shape
    x2, out = matmul_operands(x, weight)
    m = x2.shape[0]
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    block_m, block_n, block_k, split_k, warps, stages = config or choose_config(m, n, k, num_sms(x.device))
    k_per_split, split_k, partials, counters, prefetch = split_workspace(out, weight, block_k, split_k)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split_k)
    _gemm_kernel[grid](
        x2,
        weight,
        bias if bias is not None else out,
        out,
        partials,
        counters,
        m,
        n,
        k,
        x2.stride(0),
        weight.stride(0),
        out.stride(0),
        k_per_split,
        split_k,
        SPLIT=split_k > 1,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        **prefetch,
        num_warps=warps,
        num_stages=stages,
        **pdl_args(x.device, m),
    )
    return out.reshape(*x.shape[:-1], n)
