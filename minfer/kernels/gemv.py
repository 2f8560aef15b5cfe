"""Batch-1 (and few-row) GEMV in Triton: y = x @ w.T (+ bias) with the weights read before x exists.

Why a second small-GEMM kernel beside minfer.kernels.gemm: at one row a decode GEMM is a read of
its weights, and the split-K kernel still pays ~4 us per launch above those bytes (a first load's
DRAM latency, a K loop with few loads in flight, the split reduction). Here every program loads
its whole [BLOCK_N, K] slice of the weights in one go (all of its loads in flight at once, no K
loop, no split, so no reduction), and only then waits for x.

The wait is programmatic dependent launch (Hopper and later): the kernel is launched with
`launch_pdl`, so it may start while the kernel before it (an RMSNorm, the SiLU-and-multiply, the
attention kernels, which release their dependents in `pdl.pdl_start`) is still running. Its weight
loads then overlap that kernel; `gdc_wait` blocks until the previous kernel has finished and its
writes are visible, and nothing that kernel writes (x) is read, and nothing is written, before
it. Weights and bias are constant for the engine's life, which is what makes the early read safe.

Two prologues take a launch each off a decode layer (`normed_gemv`, `gated_gemv`): the RMSNorm
(with its residual add) before the qkv and gate_up projections, and the SiLU-and-multiply before
the down projection, each make one row that a gemv program can make itself from its inputs,
since it holds the whole of K anyway. So every program recomputes it after the wait (the row
comes from L2: K values, against the BLOCK_N x K weights it streams from DRAM), and program 0
alone writes the residual stream's new value, to a fresh tensor that no program reads.

The SiLU-and-multiply can instead end the gate_up projection (`gate_up_gemv`, the epilogue): a
program there takes BLOCK_N rows of the gate's weights and the same rows of the up's, so it holds
both factors of its BLOCK_N outputs and writes silu(gate) * up, the down projection's input. That
removes the launch without any re-read (the prologue's cost, which grows with the down
projection's grid), and the gate_up product writes half as many values.

The sum over K runs in fp32 on CUDA cores (a reduction across the tile), so the result differs
from cuBLAS's only in summation order. Rows of x may be strided; the last dim must be contiguous.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from minfer.kernels.common import matmul_operands, num_sms
from minfer.kernels.pdl import pdl_enabled, pdl_start

# Where it beats the split-K GEMM and cuBLAS on an H200 (scripts/gpu_gemv.py --sweep, CUDA-graph
# timed, weights from DRAM): one row at every Qwen3-0.6B and Llama-3.1-8B shape (o_proj 5.05 ->
# 2.20 us and 12.50 -> 9.59, gate_up 5.95 -> 4.21 and 55.5 -> 53.0); two rows with K up to 8192,
# with half the slice per program and 4 warps (the measured best there); from four rows on, and at
# two rows of Llama's down (K = 14336), it loses to them.
MAX_ROWS = 2
MAX_K = 16384  # the whole K of one output row must fit one program's registers
MAX_K_TWO_ROWS = 8192
# Weight elements one program holds: 32 KB of bf16 at one row (64 registers per thread over 8
# warps), half of that at two rows.
_SLICE_ELEMENTS = 16384
# Each program of a prologue re-reads its rows' two inputs (x and the residual, or gate and up)
# from L2 after its wait and makes the row before its products: a cost that grows with the grid
# (programs x rows x 2K elements, "the re-read") while the launch it saves does not. Measured on
# the H200 per prologue, in layer chains of three shapes (docs/BENCHMARKS.md, nineteenth
# session): at one row every RMSNorm fold paid or broke even (re-reads of 1-112 MB; Llama-3.1-8B's
# qkv -2.4 us); at two rows the norm paid up to a 16 MB re-read and lost from 48 MB; the SiLU,
# whose row is the wide intermediate one, broke even at 3 MB and lost from 12 MB (Qwen3-1.7B's
# down at 24 MB +4.9 us, Llama's at 224 MB +31 us).
NORM_REREAD_BYTES_TWO_ROWS = 16 << 20
SILU_REREAD_BYTES = 8 << 20
# MINFER_GEMV=off sends these products back to minfer.kernels.gemm / cuBLAS, for A/B runs.
_GEMV = os.environ.get("MINFER_GEMV", "on")
# What each program does to its row of x after the wait, before the products (see normed_gemv
# and gated_gemv): nothing, an RMSNorm (with the residual add), or SiLU(gate) * up.
_PLAIN, _NORM, _SILU = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    norm_w_ptr,
    residual_ptr,
    residual_out_ptr,
    eps,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_rm,
    ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    k_mask = offs_k < K
    # Constant inputs first: they do not depend on the kernel this one may overlap.
    w = tl.load(
        w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
        mask=n_mask[:, None] & k_mask[None, :],
        other=0.0,
    )
    if GATED:  # the up projection's rows follow the gate's N rows
        w_up = tl.load(
            w_ptr + (offs_n[:, None] + N).to(tl.int64) * stride_wn + offs_k[None, :],
            mask=n_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if GATED:
            bias_up = tl.load(bias_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if PROLOGUE == _NORM:
        norm_w = tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    pdl_start(PDL, PDL)  # wait, then release: from here the previous kernel has finished, x is written
    for m in tl.static_range(ROWS):
        x = tl.load(x_ptr + m * stride_xm + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        # The prologues round where minfer.kernels.norm / activation round before they store.
        if PROLOGUE == _NORM:
            if HAS_RESIDUAL:
                r = tl.load(residual_ptr + m * stride_rm + offs_k, mask=k_mask, other=0.0)
                summed = (x + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
                if tl.program_id(0) == 0:  # one program writes the residual stream's new value
                    tl.store(residual_out_ptr + m * K + offs_k, summed, mask=k_mask)
                x = summed.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / K + eps)
            normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
            x = (normed * norm_w).to(x_ptr.dtype.element_ty).to(tl.float32)
        if PROLOGUE == _SILU:  # x's row holds [gate | up], K each
            up = tl.load(x_ptr + m * stride_xm + K + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            silu = (x / (1.0 + tl.exp(-x))).to(x_ptr.dtype.element_ty).to(tl.float32)
            x = (silu * up).to(x_ptr.dtype.element_ty).to(tl.float32)
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if HAS_BIAS:
            acc += bias
        if GATED:  # rounded where the unfused gemv and minfer.kernels.activation round
            acc_up = tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)
            if HAS_BIAS:
                acc_up += bias_up
            gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
            acc = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32) * up
        tl.store(out_ptr + m * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


def choose_config(n: int, k: int, num_sms: int, rows: int = 1) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): BLOCK_K covers all of K; BLOCK_N output rows per program,
    at most _SLICE_ELEMENTS weights each (half at two rows), and fewer while that leaves under
    1.5 programs per SM (so most SMs have the loads of two programs in flight). The warps are
    the measured best: 8 for a full one-row slice, 4 otherwise."""
    block_k = triton.next_power_of_2(k)
    elements = _SLICE_ELEMENTS if rows == 1 else _SLICE_ELEMENTS // 2
    block_n = max(1, min(64, elements // block_k))
    while block_n > 1 and triton.cdiv(n, block_n) < num_sms * 3 // 2:
        block_n //= 2
    return block_n, block_k, 8 if rows == 1 and block_n * block_k >= 8192 else 4


def gated_config(n: int, k: int, num_sms: int, rows: int = 1) -> tuple[int, int, int]:
    """`choose_config` for `gate_up_gemv`'s n outputs: the grid and register footprint of the
    unfused gate_up product (2n rows), each program's rows split between the gate and the up."""
    block_n, block_k, warps = choose_config(2 * n, k, num_sms, rows)
    return max(1, block_n // 2), block_k, warps


def suits(rows: int, weight: torch.Tensor) -> bool:
    """Whether `gemv` should take this product (see MAX_ROWS)."""
    k = weight.shape[1]
    return _GEMV != "off" and (rows == 1 and k <= MAX_K or rows == 2 and k <= MAX_K_TWO_ROWS)


def prologue_pays(rows: int, weight: torch.Tensor, silu: bool) -> bool:
    """Whether folding the step before this product into gemv's prologue (`gated_gemv` with
    `silu`, else `normed_gemv`) should be faster than launching it: where gemv takes the product
    and its grid's re-read is within the bound measured for that prologue (see above)."""
    if not suits(rows, weight):
        return False
    if not silu and rows == 1:
        return True
    n, k = weight.shape
    reread = triton.cdiv(n, choose_config(n, k, num_sms(weight.device), rows)[0]) * rows * 2 * k
    return reread * weight.element_size() <= (SILU_REREAD_BYTES if silu else NORM_REREAD_BYTES_TWO_ROWS)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias[N]) -> [..., N] in x's dtype, accumulated in fp32,
    for at most MAX_ROWS rows of x. `out`: a contiguous [rows, N] tensor to write instead, in
    x's dtype or float32 (the sum then unrounded: the LM head's logits)."""
    x2, out = matmul_operands(x, weight, out=out)
    _launch(x2, weight, bias, out, config, _PLAIN)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def normed_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gemv(rmsnorm(x [+ residual]) * norm_weight, weight, bias), x [+ residual]) in one kernel:
    what `rmsnorm(x, norm_weight, eps, residual)` followed by `gemv` returns, the RMSNorm done
    by every program on its own copy of the row (K is whole in each) instead of by a launch of
    its own. Without `residual` the residual stream returned is x itself. norm_weight must have
    x's dtype (so the norm's output rounds to it, as the unfused pair's does)."""
    x2, out = matmul_operands(x, weight)
    residual, summed = _norm_operands(x, x2, norm_weight, residual)
    _launch(x2, weight, bias, out, config, _NORM, norm_weight, eps, residual, summed)
    return out.reshape(*x.shape[:-1], weight.shape[0]), summed


def gated_gemv(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """gemv(silu(gate) * up, weight, bias) for gate_up [..., 2K] holding [gate | up], in one
    kernel: what minfer.kernels.activation.silu_and_mul followed by `gemv` returns."""
    n, k = weight.shape
    if gate_up.shape[-1] != 2 * k:
        raise ValueError(f"gate_up has {gate_up.shape[-1]} features, weight expects 2 x {k}")
    x2, out = matmul_operands(gate_up, weight, features=2 * k)
    _launch(x2, weight, bias, out, config, _SILU)
    return out.reshape(*gate_up.shape[:-1], n)


def gate_up_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(gate) * up, the residual stream) for [gate | up] = gemv(x', weight [2N, K], bias),
    x' = x, or rmsnorm(x [+ residual]) * norm_weight with `norm_weight` (as in `normed_gemv`):
    what the gate_up product and minfer.kernels.activation.silu_and_mul return one after the
    other, in one kernel. config is `gated_config`'s form."""
    if weight.shape[0] % 2:
        raise ValueError(f"weight has {weight.shape[0]} rows: it must hold [gate | up]")
    n, k = weight.shape[0] // 2, weight.shape[1]
    x2, out = matmul_operands(x, weight[:n])
    summed, prologue = x, _PLAIN
    if norm_weight is not None:
        residual, summed = _norm_operands(x, x2, norm_weight, residual)
        prologue = _NORM
    elif residual is not None:
        raise ValueError("a residual is added only with the norm prologue")
    config = config or gated_config(n, k, num_sms(x2.device), x2.shape[0])
    _launch(x2, weight, bias, out, config, prologue, norm_weight, eps, residual, summed, gated=True)
    return out.reshape(*x.shape[:-1], n), summed


def _norm_operands(x, x2, norm_weight, residual):
    """The norm prologue's residual as rows like x2's, and the residual stream's output: a fresh
    tensor with a residual, else x itself."""
    if norm_weight.shape != (x.shape[-1],) or norm_weight.dtype != x.dtype:
        raise ValueError("norm_weight must be [K] in x's dtype")
    if residual is None:
        return None, x
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError("residual must have the shape and dtype of x")
    residual = residual.reshape(x2.shape)
    if residual.stride(-1) != 1:
        residual = residual.contiguous()
    return residual, torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _launch(
    x2,
    weight,
    bias,
    out,
    config,
    prologue,
    norm_weight=None,
    eps=0.0,
    residual=None,
    summed=None,
    gated=False,
):
    """One launch over x2's rows (x2 [M, K], or [M, 2K] for the SiLU prologue) into out [M, N]
    (N = weight's rows, or half of them `gated`)."""
    n, k = weight.shape
    if gated:
        n //= 2
    if k > MAX_K:
        raise ValueError(f"K = {k} is over gemv's {MAX_K}: use minfer.kernels.gemm")
    m = x2.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"{m} rows is over gemv's {MAX_ROWS}: use minfer.kernels.gemm")
    if m == 0:
        return
    block_n, block_k, warps = config or choose_config(n, k, num_sms(x2.device), m)
    pdl = pdl_enabled(x2.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x2,
        weight,
        bias if bias is not None else out,
        out,
        norm_weight if norm_weight is not None else out,
        residual if residual is not None else out,
        summed if residual is not None else out,
        eps,
        n,
        k,
        x2.stride(0),
        weight.stride(0),
        out.stride(0),
        residual.stride(0) if residual is not None else 0,
        ROWS=m,
        HAS_BIAS=bias is not None,
        PROLOGUE=prologue.value,
        HAS_RESIDUAL=residual is not None,
        GATED=gated,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PDL=pdl,
        num_warps=warps,
        **({"launch_pdl": True} if pdl else {}),
    )
