"""Fused mixture-of-experts in Triton: sort tokens by expert, two grouped GEMMs, one sum.

1. `align_to_experts`: each (token, slot) assignment is a row; rows are sorted by expert and
   each expert's run is padded to a multiple of BLOCK_M, so a block of BLOCK_M rows belongs to
   one expert. Output shapes depend on (tokens, top_k, experts, BLOCK_M) alone (no host sync),
   so a decode step stays capturable in a CUDA graph; pad rows carry the sentinel
   `tokens * top_k` and blocks past the padded total exit at once. Up to ALIGN_KERNEL_MAX_ROWS
   rows (decode) it is one Triton launch, one program per expert; beyond, about twenty torch
   ops (`align_to_experts_torch`, also the kernel's oracle), whose launches a prefill hides.
2. gate_up GEMM: for each block, the gate and up tiles of its expert are accumulated side by
   side and SiLU(gate) * up is stored (the [rows, intermediate] activation never exists
   unfused).
3. down GEMM: the same kernel without the gate; its epilogue multiplies each row by its
   routing weight, so rows of one token only need adding.
4. One reduction per token: out = rows.view(tokens, top_k, hidden).sum(1), or none: the
   decoder's next RMSNorm sums the rows into its residual add (`reduce=False`).

Experts that received no tokens own no block, so their weights are never read: a decode step
reads only the experts its tokens chose. Block sizes come from moe_configs.json (decode: few
rows per expert; prefill: many), chosen by the mean rows per expert.

With fewer rows still (batch-1 decode: 8 rows over 128 experts) almost every row is alone in
its expert's block anyway, so step 1 is skipped: each row is its own block (`one_row_blocks`),
whose expert is read straight from topk_ids. Two tokens that chose one expert then read its
weights twice, which costs less than the align launch while rows are few against experts
(`one_row_max_rows_per_expert`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from minfer.kernels.common import dot

CONFIGS = Path(__file__).with_name("moe_configs.json")


@functools.cache
def block_configs() -> dict:
    with open(CONFIGS) as f:
        return json.load(f)


def config_for(num_rows: int, num_experts: int, element_size: int = 2) -> dict:
    """The block config for `num_rows` = tokens x top_k assignments spread over the experts.
    The tables are for 2-byte types; float32 tiles are twice the bytes, so fewer pipeline
    stages keep them within shared memory (the gated GEMM holds three tiles per stage)."""
    table = block_configs()
    if num_rows / num_experts <= table["one_row_max_rows_per_expert"]:
        config = dict(table["one_row"], one_row_blocks=True)
    elif num_rows / num_experts <= table["decode_max_rows_per_expert"]:
        config = dict(table["decode"])
    else:
        config = dict(table["prefill"])
    if element_size > 2:
        config["num_stages"] = min(config["num_stages"], 2)
        if "down" in config:  # the down GEMM's own tiles (see fused_moe)
            config["down"] = dict(config["down"], num_stages=min(config["down"].get("num_stages", 2), 2))
    return config


# Each program of the align kernel scans all rows (once to count every expert's rows, once for
# its own): cheap for a decode step's few rows, quadratic-ish waste for a prefill's thousands.
ALIGN_KERNEL_MAX_ROWS = 4096
_ALIGN_CHUNK = 64  # rows per step of the align kernel's scans ([chunk, experts] compares)


def _capacity(num_rows: int, num_experts: int, block_m: int) -> int:
    # at most min(experts, rows) groups get padding, each less than one block
    return triton.cdiv(num_rows + min(num_experts, num_rows) * (block_m - 1), block_m) * block_m


def align_to_experts(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, use_kernel: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_rows int32 [capacity], block_expert int32 [capacity / block_m], padded_total
    int32 [1]): rows (flat indices into topk_ids) grouped by expert in row order, each group
    padded to a multiple of block_m with the sentinel topk_ids.numel(); the expert of every
    block. Entries past padded_total are unspecified (the GEMMs never read them)."""
    n = topk_ids.numel()
    if use_kernel is None:
        use_kernel = topk_ids.is_cuda and n <= ALIGN_KERNEL_MAX_ROWS
    if not use_kernel:
        return align_to_experts_torch(topk_ids, num_experts, block_m)
    capacity = _capacity(n, num_experts, block_m)
    device = topk_ids.device
    sorted_rows = torch.empty(capacity, dtype=torch.int32, device=device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    padded_total = torch.empty(1, dtype=torch.int32, device=device)
    _align_kernel[(num_experts,)](
        topk_ids.reshape(-1),
        sorted_rows,
        block_expert,
        padded_total,
        n,
        BLOCK_M=block_m,
        CHUNK=_ALIGN_CHUNK,
        EXPERTS=triton.next_power_of_2(num_experts),
        MAX_BLOCKS=triton.next_power_of_2(triton.cdiv(n, block_m)),
    )
    return sorted_rows, block_expert, padded_total


@triton.jit
def _align_kernel(
    ids_ptr,
    sorted_rows_ptr,
    block_expert_ptr,
    padded_total_ptr,
    n,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    EXPERTS: tl.constexpr,
    MAX_BLOCKS: tl.constexpr,
):
    """Program e: count every expert's rows (for e's offset: the padded sizes of experts < e),
    then write e's rows in row order, its pad rows, and the expert id of its blocks."""
    e = tl.program_id(0)
    experts = tl.arange(0, EXPERTS)
    counts = tl.zeros((EXPERTS,), dtype=tl.int32)
    for r0 in range(0, n, CHUNK):
        r = r0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + r, mask=r < n, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    offset = tl.sum(tl.where(experts < e, padded, 0))
    count = tl.sum(tl.where(experts == e, counts, 0))
    seen = count * 0  # rows of e written so far (a tensor, so the loop may carry it)
    for r0 in range(0, n, CHUNK):
        r = r0 + tl.arange(0, CHUNK)
        mine = tl.load(ids_ptr + r, mask=r < n, other=-1).to(tl.int32) == e
        rank = seen + tl.cumsum(mine.to(tl.int32), axis=0) - 1
        tl.store(sorted_rows_ptr + offset + rank, r.to(tl.int32), mask=mine)
        seen += tl.sum(mine.to(tl.int32))
    pad = count + tl.arange(0, BLOCK_M)
    padded_e = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    tl.store(sorted_rows_ptr + offset + pad, n, mask=pad < padded_e)
    blocks = tl.arange(0, MAX_BLOCKS)
    tl.store(block_expert_ptr + offset // BLOCK_M + blocks, e, mask=blocks < padded_e // BLOCK_M)
    if e == 0:
        tl.store(padded_total_ptr, tl.sum(padded))


def align_to_experts_torch(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`align_to_experts` as torch ops (prefill, and the align kernel's oracle)."""
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    capacity = _capacity(n, num_experts, block_m)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    expert_of_sorted = flat[order]
    start = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(n, device=flat.device) - start[expert_of_sorted]
    dest = (padded_end - padded)[expert_of_sorted] + rank_in_expert
    sorted_rows = torch.full((capacity,), n, dtype=torch.int32, device=flat.device)
    sorted_rows[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_rows, block_expert.to(torch.int32), padded_end[-1:].to(torch.int32)


def one_row_blocks(topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `aligned` triple of the one-row-per-block layout: block m is row m and its expert is
    topk_ids' m-th entry; no kernel runs (the GEMMs ignore the other two entries)."""
    flat = topk_ids.reshape(-1)
    return flat, flat, flat


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    row_weight_ptr,
    sorted_rows_ptr,
    block_expert_ptr,
    padded_total_ptr,
    num_rows,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    A_ROWS_PER_TOKEN: tl.constexpr,
    ONE_ROW_BLOCKS: tl.constexpr,
    GATED: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[row, n] = sum_k a[row // A_ROWS_PER_TOKEN, k] * w[expert, n, k] for the rows of
    one expert's block. GATED: w holds [gate; up] (2N rows) and out = SiLU(gate) * up.
    WEIGHTED: out is scaled by row_weight[row] (the routing weight).
    ONE_ROW_BLOCKS: block m is row m alone (the other lanes are padding) and block_expert is
    topk_ids itself; sorted_rows and padded_total are not read."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if ONE_ROW_BLOCKS:
        rows = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_rows)
    else:
        if pid_m * BLOCK_M >= tl.load(padded_total_ptr):
            return
        rows = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    row_mask = rows < num_rows
    a_rows = (rows // A_ROWS_PER_TOKEN).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += dot(a, w)
        if GATED:
            w_up = tl.load(w_ptrs + N * stride_wn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc_up += dot(a, w_up)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if WEIGHTED:
        acc *= tl.load(row_weight_ptr + rows, mask=row_mask, other=0.0)[:, None]
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    config: dict,
    a_rows_per_token: int,
    gated: bool,
    row_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """One launch over every expert's blocks (see `_grouped_gemm_kernel`)."""
    sorted_rows, block_expert, padded_total = aligned
    n = w.shape[1] // 2 if gated else w.shape[1]
    grid = (block_expert.numel(), triton.cdiv(n, config["BLOCK_N"]))
    _grouped_gemm_kernel[grid](
        a,
        w,
        out,
        row_weight if row_weight is not None else out,
        sorted_rows,
        block_expert,
        padded_total,
        out.shape[0],
        n,
        w.shape[2],
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        A_ROWS_PER_TOKEN=a_rows_per_token,
        ONE_ROW_BLOCKS=config.get("one_row_blocks", False),
        GATED=gated,
        WEIGHTED=row_weight is not None,
        BLOCK_M=config["BLOCK_M"],
        BLOCK_N=config["BLOCK_N"],
        BLOCK_K=config["BLOCK_K"],
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    return out


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: dict | None = None,
    reduce: bool = True,
) -> torch.Tensor:
    """sum over each token's experts e of weight_e * down_e(SiLU(gate_e x) * up_e x).
    x [tokens, hidden] (last dim contiguous); gate_up [experts, 2I, hidden]; down
    [experts, hidden, I]; topk_* [tokens, top_k]. With reduce=False the terms of the sum,
    [tokens, top_k, hidden], for a consumer that adds them itself (kernels/norm.py)."""
    tokens, top_k = topk_ids.shape
    num_experts, hidden, inter = down.shape
    rows = tokens * top_k
    config = config or config_for(rows, num_experts, x.element_size())
    if config.get("one_row_blocks"):
        aligned = one_row_blocks(topk_ids)
    else:
        aligned = align_to_experts(topk_ids, num_experts, config["BLOCK_M"])
    activation = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    grouped_gemm(x, gate_up, activation, aligned, config, top_k, gated=True)
    expert_out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32)
    down_config = {**config, **config.get("down", {})}  # the table may tile the down GEMM apart
    grouped_gemm(activation, down, expert_out, aligned, down_config, 1, gated=False, row_weight=weights)
    terms = expert_out.view(tokens, top_k, hidden)
    return terms.sum(dim=1) if reduce else terms
