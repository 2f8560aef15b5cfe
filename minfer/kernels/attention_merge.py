"""Pass 2 of paged decode attention (attention_decode.py): the splits' partial outputs of each
(request, q head) merged by their log-sum-exp (base 2). A separate launch, because every split
of a (request, kv head) must have finished first. Folding it into pass 1 (the last split to
arrive, counted by an atomic, merges its group) was measured slower on an H200 twice: looping
over 64 splits one at a time (MoE batch 1, +0.55 ms a step), and reading only the live splits
a chunk at a time (Qwen3-0.6B batch 1, 0.715 -> 0.770 ms a graph): the last program's atomic and
dependent loads sit on the critical path, where the launch's wait is hidden by programmatic
dependent launch (docs/PERFORMANCE.md section 24)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minfer.kernels.pdl import pdl_args, pdl_start


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
