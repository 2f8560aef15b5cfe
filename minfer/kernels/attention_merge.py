"""Pass 2 of paged decode attention (attention_decode.py): the splits' partial outputs of each
(request, q head) merged by their log-sum-exp (base 2).

Two forms. `merge_splits` is a launch of its own, after every split has finished. And
`merge_group_splits` runs inside the split kernel, in the last program of a (request, kv head)
to arrive (an arrival counter): no launch, no boundary, at the price of an atomic on the
critical path. A first fold (MoE batch 1, 2026-12-01) looped over all 64 splits one at a time
and was slower than the launch; this one reads only the live splits, a chunk at a time."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minfer.kernels.common import pdl_args, pdl_start


@triton.jit
def _decode_merge_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_ob,
    stride_oh,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL_RELEASE: tl.constexpr,
    PDL_WAIT: tl.constexpr,
):
    pdl_start(PDL_RELEASE, PDL_WAIT)  # the o_proj gemv may read its weights meanwhile
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    base = (b * NUM_HEADS + head) * num_splits
    lse = tl.load(part_lse_ptr + base + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # no keys at all: output 0, not NaN
    weights = tl.exp2(lse - lse_max)
    # Every split's partial output is loaded beside the log-sum-exps rather than after them (a
    # second round trip); an empty split's was never written, so it is zeroed, not weighed.
    parts = tl.load(
        part_out_ptr + (base + offs_s)[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :],
        mask=(offs_s < num_splits)[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    parts = tl.where((lse > float("-inf"))[:, None], parts, 0.0)
    total = tl.sum(weights, 0)
    total = tl.where(total > 0, total, 1.0)
    o = tl.sum(parts * weights[:, None], 0) / total
    tl.store(
        out_ptr + b * stride_ob + head * stride_oh + offs_d,
        o.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


@triton.jit
def merge_group_splits(
    out_rows,
    part_out_rows,
    part_lse_rows,
    stride_oh,
    num_splits,
    live,
    offs_d,
    d_mask,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CHUNK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The merge of one (request, kv head) inside the decode kernel (attention_decode.py's folded
    merge): its GROUP q heads' splits [0, live) weighted by exp2(lse). `part_out_rows` and
    `part_lse_rows` point at the group's first head; `out_rows` at its first output row. The
    partials were written by other programs: they are read past L1 (.cg). Splits are taken
    CHUNK_S at a time, each chunk's loads issued together (a loop of one split per trip was
    latency-bound: docs/BENCHMARKS.md, MoE batch-1 table)."""
    offs_g = tl.arange(0, GROUP_P2)
    g_mask = offs_g < GROUP
    offs_s = tl.arange(0, BLOCK_S)
    lse = tl.load(
        part_lse_rows + offs_g[:, None] * num_splits + offs_s[None, :],
        mask=g_mask[:, None] & (offs_s < live)[None, :],
        other=float("-inf"),
        cache_modifier=".cg",
    )
    lse_max = tl.max(lse, 1)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # no keys at all: output 0, not NaN
    acc = tl.zeros([GROUP_P2, BLOCK_D], dtype=tl.float32)
    total = tl.zeros([GROUP_P2], dtype=tl.float32)
    offs_c = tl.arange(0, CHUNK_S)
    for s0 in range(0, live, CHUNK_S):
        splits = s0 + offs_c
        rows = offs_g[:, None] * num_splits + splits[None, :]  # [GROUP_P2, CHUNK_S]
        in_chunk = g_mask[:, None] & (splits < live)[None, :]
        chunk_lse = tl.load(part_lse_rows + rows, mask=in_chunk, other=float("-inf"), cache_modifier=".cg")
        parts = tl.load(
            part_out_rows + rows[:, :, None].to(tl.int64) * HEAD_DIM + offs_d[None, None, :],
            mask=in_chunk[:, :, None] & d_mask[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        weights = tl.exp2(chunk_lse - lse_max[:, None])  # 0 where lse is -inf (an empty slice)
        parts = tl.where((chunk_lse > float("-inf"))[:, :, None], parts, 0.0)
        acc += tl.sum(parts * weights[:, :, None], 1)
        total += tl.sum(weights, 1)
    total = tl.where(total > 0, total, 1.0)
    o = acc / total[:, None]
    tl.store(
        out_rows + offs_g[:, None] * stride_oh + offs_d[None, :],
        o.to(out_rows.dtype.element_ty),
        mask=g_mask[:, None] & d_mask[None, :],
    )


def merge_splits(out: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> torch.Tensor:
    """out[b, h] = the splits of part_out [B, Hq, S, D] (fp32, normalised) weighted by
    exp2(part_lse [B, Hq, S]); splits with lse -inf (empty slices) weigh zero."""
    batch, num_heads, num_splits, head_dim = part_out.shape
    _decode_merge_kernel[(batch, num_heads)](
        out,
        part_out,
        part_lse,
        out.stride(0),
        out.stride(1),
        num_splits,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
        **pdl_args(out.device, batch),
    )
    return out
