"""Random paged KV caches and batches for the kernel tests (and scripts/gpu_check.py), and the
tolerance the GEMM kernels' tests share."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    """A KV pool filled with random K/V, and a batch of requests whose slots are scattered."""

    k_pool: torch.Tensor  # [slots + page_size, Hk, D]
    v_pool: torch.Tensor
    page_table: torch.Tensor  # [rows, max_len] int32
    table_idx: torch.Tensor  # [B] int32
    prefix_lens: torch.Tensor  # [B] int32
    seq_lens: torch.Tensor  # [B] int32
    cu_extend_lens: torch.Tensor  # [B + 1] int32
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    table_idx_cpu: list[int]


def make_paged_batch(
    prefix_lens: list[int],
    extend_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator,
    table_width: int | None = None,
) -> PagedBatch:
    """Pages of every request are taken from a shuffled list of all pages, so consecutive pages
    of one request are far apart in the pool; each request gets a random page-table row."""
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pages_per_req = [-(-s // page_size) for s in seq_lens]
    num_pages = sum(pages_per_req) + 2  # a little slack nobody owns
    num_slots = num_pages * page_size
    order = torch.randperm(num_pages, generator=generator)
    width = table_width or max(seq_lens) + 7
    rows = len(seq_lens) + 3
    page_table = torch.zeros((rows, width), dtype=torch.int32)
    table_idx = torch.randperm(rows, generator=generator)[: len(seq_lens)]
    used = 0
    for row, seq, npages in zip(table_idx.tolist(), seq_lens, pages_per_req):
        pages = order[used : used + npages]
        used += npages
        slots = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)
        page_table[row, :seq] = slots[:seq].to(torch.int32)
    shape = (num_slots + page_size, num_kv_heads, head_dim)
    if device.type == "cpu":
        k_pool = torch.randn(shape, generator=generator).to(dtype)
        v_pool = torch.randn(shape, generator=generator).to(dtype)
    else:  # GPU-sized pools: drawing gigabytes on the CPU would take longer than the check itself
        k_pool = torch.randn(shape, device=device, dtype=dtype)
        v_pool = torch.randn(shape, device=device, dtype=dtype)
    cu = [0]
    for e in extend_lens:
        cu.append(cu[-1] + e)

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    return PagedBatch(
        k_pool=k_pool.to(device),
        v_pool=v_pool.to(device),
        page_table=page_table.to(device),
        table_idx=table_idx.to(torch.int32).to(device),
        prefix_lens=ints(prefix_lens),
        seq_lens=ints(seq_lens),
        cu_extend_lens=ints(cu),
        prefix_lens_cpu=list(prefix_lens),
        extend_lens_cpu=list(extend_lens),
        table_idx_cpu=table_idx.tolist(),
    )


def tolerance(dtype: torch.dtype) -> dict:
    return {
        torch.float32: dict(atol=1e-5, rtol=1e-5),
        torch.float16: dict(atol=2e-3, rtol=2e-3),
        torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    }[dtype]


def gemm_tolerance(dtype: torch.dtype) -> dict:
    """assert_close tolerance of a GEMM kernel against float64 rounded to `dtype`: fp32 runs
    true fp32 products; half types accumulate in fp32 and round once, so one unit in the last
    place (two under Triton's interpreter, which truncates instead of rounding)."""
    if dtype == torch.float32:
        return dict(atol=1e-4, rtol=1e-5)
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    return dict(atol=1e-3, rtol=ulp if torch.cuda.is_available() else 2 * ulp)
