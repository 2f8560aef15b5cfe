"""Small-batch GEMM in Triton: y = x @ w.T (+ bias) for decode steps (few rows, small weights).

Why not cuBLAS here: with a handful of token rows the product is a read of the weights, and
a decode step of a small model is dozens of such reads of a few MB each. cuBLAS launches few
programs for narrow outputs (Qwen3-0.6B's o_proj at one row: 12.6 us for 4 MB, a 1 us read)
and its fixed cost per call dominates. This kernel splits K as well, so about one program per
SM reads a slice of the weights (o_proj at one row: 5.0 us). Where it is used is set by
`suits`: measured on an H200 (docs/BENCHMARKS.md), it wins or ties up to 64 rows on Qwen3-0.6B's
weights and loses to cuBLAS's larger tensor-core tiles beyond.

How the splits are summed without a second kernel (which would cost a graph node and its
launch gap per GEMM): each program writes its fp32 partial tile to a workspace, then bumps the
tile's arrival counter. The program that arrives last adds all partials of the tile in split
order (0, 1, ...), so the result does not depend on which program finished first, writes the
output and resets the counter to zero for the next launch. The counters live in one zeroed
buffer per device; GEMMs on one stream run one after another, so they never share a counter
while it is non-zero.

Rows of x may be strided (views of a larger activation); the last dim must be contiguous.

The launches either side of a decode GEMM can be folded into it (`norm`, `gated`, `residual`),
which is how a decoder layer of a small batch runs in four GEMM launches and its attention
instead of seven launches (models/llama.py): a decode step of a small model is bound by the
number of launches more than by the bytes they read (docs/PERFORMANCE.md).
  norm      RMSNorm of x's rows before the product (the input RMSNorm of attention or MLP):
            every program first sums the squares of its rows over all of K, then normalises
            each K block as it loads it.
  gated     x holds [gate | up] of twice K features and the product takes silu(gate) * up
            (the MLP's down projection eats the SiLU-and-multiply).
  residual  the output is residual + x @ w.T (the residual add after o_proj and down).
Each rounds where the separate kernel rounds (kernels/norm.py, kernels/activation.py), so the
fused layer's values are the unfused layer's up to the order of the sum of squares.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from minfer.kernels.common import dot, num_sms

# Where this kernel was measured to match or beat cuBLAS on an H200 (scripts/gpu_check.py
# --gemm): up to 64 rows, weights up to Qwen3-0.6B's largest (gate_up, 6144 x 1024), and
# Qwen3-30B-A3B's o_proj (2048 x 4096), where cuBLAS picks a split-K GEMM plus a separate
# reduction (batch-1 decode 3.99 -> 3.93 ms per step through this kernel). Llama-8B's weights
# (16M+ elements) stream at close to bandwidth in cuBLAS, and more rows want cuBLAS's bigger
# tensor-core tiles; Qwen3-30B-A3B's qkv (5120 x 2048) was no faster here.
MAX_ROWS = 64
MAX_WEIGHT_ELEMENTS = 4096 * 2048
_MAX_TILES = 4096  # arrival counters per device: one per output tile of a split launch
NONE, NORM, GATED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)  # PROLOGUE


@triton.jit
def _gemm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    norm_weight_ptr,
    residual_ptr,
    eps,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_rm,
    k_per_split,
    num_splits,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PROLOGUE: tl.constexpr,  # NONE, NORM or GATED
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
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
    x_tile = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_start + offs_k)[None, :]
    w_tile = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (k_start + offs_k)[:, None]  # [K, N]
    if PROLOGUE == NORM:  # the rows' sum of squares over all of K, whatever this split's slice
        rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k in tl.range(0, K, BLOCK_K):
            xk = tl.load(rows + k, mask=m_mask[:, None] & (k + offs_k < K)[None, :], other=0.0)
            squares += tl.sum(xk.to(tl.float32) * xk.to(tl.float32), 1)
        rstd = 1.0 / tl.sqrt(squares / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in tl.range(0, k_per_split, BLOCK_K):
        k_mask = k_start + k + offs_k < K
        x_mask = m_mask[:, None] & k_mask[None, :]
        if PROLOGUE == GATED:  # silu(gate) rounded, times up, rounded: kernels/activation.py
            gate = tl.load(x_tile + k, mask=x_mask, other=0.0).to(tl.float32)
            up = tl.load(x_tile + K + k, mask=x_mask, other=0.0).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
            x = (silu * up).to(x_ptr.dtype.element_ty)
        else:
            x = tl.load(x_tile + k, mask=x_mask, other=0.0)
        if PROLOGUE == NORM:  # normalised value rounded, times the weight, rounded: kernels/norm.py
            nw = tl.load(norm_weight_ptr + k_start + k + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            normed = (x.to(tl.float32) * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
            x = (normed * nw[None, :]).to(x_ptr.dtype.element_ty)
        w = tl.load(w_tile + k, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += dot(x, w)

    out_mask = m_mask[:, None] & n_mask[None, :]
    out_tile = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    residual_tile = residual_ptr + offs_m[:, None].to(tl.int64) * stride_rm + offs_n[None, :]
    if SPLIT:
        num_m = tl.num_programs(1)
        tile = pid_n * num_m + pid_m
        # partials: [num_splits, M, N] fp32
        part = partial_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(part + split.to(tl.int64) * M * N, acc, mask=out_mask)
        # Every thread's partial store must precede the arrival (release) that publishes it.
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for _ in range(num_splits):  # fixed order: the sum is the same whoever arrives last
                acc += tl.load(part, mask=out_mask, other=0.0, cache_modifier=".cg")
                part += M * N
            _store_tile(
                acc, out_tile, out_mask, bias_ptr + offs_n, n_mask, residual_tile, HAS_BIAS, HAS_RESIDUAL
            )
            tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")
    else:
        _store_tile(acc, out_tile, out_mask, bias_ptr + offs_n, n_mask, residual_tile, HAS_BIAS, HAS_RESIDUAL)


@triton.jit
def _store_tile(
    acc,
    out_tile,
    mask,
    bias_row,
    bias_mask,
    residual_tile,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """acc (+ bias) rounded to the output dtype; with a residual, residual + that, rounded
    again (the product is rounded before the add, as the separate add in kernels/norm.py)."""
    if HAS_BIAS:
        acc += tl.load(bias_row, mask=bias_mask, other=0.0).to(tl.float32)[None, :]
    y = acc.to(out_tile.dtype.element_ty)
    if HAS_RESIDUAL:
        r = tl.load(residual_tile, mask=mask, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(out_tile.dtype.element_ty)
    tl.store(out_tile, y, mask=mask)


@functools.cache
def _counters(device: torch.device) -> torch.Tensor:
    return torch.zeros(_MAX_TILES, dtype=torch.int32, device=device)


def choose_config(m: int, n: int, k: int, num_sms: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) for an [m, k] x [k, n] GEMM.

    Tiles as tall as the batch (at least 16, the smallest tensor-core tile) and 64 wide; then
    enough K splits that the launch has about one program per SM, each still looping over at
    least two K blocks.
    """
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    block_n = 32
    block_k = 128 if k >= 256 else max(16, triton.next_power_of_2(k))
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, block_k)
    split_k = max(1, min(num_sms // tiles, k_blocks // 2))
    if tiles > _MAX_TILES:
        split_k = 1
    return block_m, block_n, block_k, split_k, 4, 4


def suits(rows: int, weight: torch.Tensor) -> bool:
    """Whether `linear` should take this GEMM rather than cuBLAS (see MAX_ROWS)."""
    return rows <= MAX_ROWS and weight.numel() <= MAX_WEIGHT_ELEMENTS


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int, int] | None = None,
    *,
    norm: tuple[torch.Tensor, float] | None = None,
    gated: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias[N]) -> [..., N] in x's dtype, accumulated in fp32.

    norm=(norm_weight [K], eps): RMSNorm(x) @ weight.T. gated: x is [..., 2K] = [gate | up] and
    the product takes silu(gate) * up. residual [..., N]: returns residual + the product.
    """
    n, k = weight.shape
    if norm is not None and gated:
        raise ValueError("norm and gated are two prologues; a GEMM takes one")
    features = 2 * k if gated else k
    if x.shape[-1] != features:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {features}")
    x2 = x.reshape(-1, features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    assert weight.stride(-1) == 1
    m = x2.shape[0]
    prologue, norm_weight, eps = NONE, weight, 0.0
    if norm is not None:
        norm_weight, eps = norm
        if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype:
            raise ValueError(
                f"norm weight must be [{k}] in {x.dtype}, the rounding of the RMSNorm it replaces"
            )
        prologue = NORM
    elif gated:
        prologue = GATED
    res2 = None
    if residual is not None:
        if residual.shape != (*x.shape[:-1], n) or residual.dtype != x.dtype:
            raise ValueError("residual must have the output's shape and x's dtype")
        res2 = residual.reshape(m, n)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    block_m, block_n, block_k, split_k, warps, stages = config or choose_config(m, n, k, num_sms(x.device))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)  # rounding K up to whole blocks may leave fewer splits
    partials = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split_k)
    _gemm_kernel[grid](
        x2,
        weight,
        bias if bias is not None else out,
        out,
        partials,
        _counters(x.device),
        norm_weight,
        res2 if res2 is not None else out,
        eps,
        m,
        n,
        k,
        x2.stride(0),
        weight.stride(0),
        out.stride(0),
        res2.stride(0) if res2 is not None else 0,
        k_per_split,
        split_k,
        SPLIT=split_k > 1,
        HAS_BIAS=bias is not None,
        PROLOGUE=prologue,
        HAS_RESIDUAL=res2 is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return out.reshape(*x.shape[:-1], n)
