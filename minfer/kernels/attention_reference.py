"""Plain-torch references for the paged attention kernels: the yardstick that tests/kernels and
scripts/gpu_check.py hold `decode_attention` and `extend_attention` to.

Request by request, in float32, every mask spelled out; an fp8 pool is dequantized first, as
KVPool.gather_heads does. Decode is the one-query case of extend: the new token at seq_lens[b] - 1.
"""

from __future__ import annotations

import torch

from minfer.kernels.common import gather_rows


def extend_attention_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    table_idx: torch.Tensor,
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """extend_attention's result: query j of request b (position prefix + j) over keys
    [0, prefix + j], or with a sliding window over (prefix + j - window, prefix + j]."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_pool.shape[1]
    start = 0
    for row, prefix, seq in zip(table_idx.tolist(), prefix_lens.tolist(), seq_lens.tolist()):
        extend = seq - prefix
        slots = page_table[row, :seq].long()
        k = gather_rows(k_pool, slots, k_scale, q.dtype).repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = gather_rows(v_pool, slots, v_scale, q.dtype).repeat_interleave(group, dim=1)
        scores = torch.einsum("ehd,shd->hes", q[start : start + extend].float(), k) * scale
        visible = torch.ones(extend, seq, dtype=torch.bool, device=q.device).tril(diagonal=prefix)
        if window is not None:
            visible = visible.triu(diagonal=prefix - window + 1)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start : start + extend] = torch.einsum("hes,shd->ehd", probs, v).to(q.dtype)
        start += extend
    return out


def decode_attention_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    table_idx: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """decode_attention's result: each request's new token (q[b], at position seq_lens[b] - 1)
    over its keys, the last `window` of them with a sliding window."""
    prefix_lens = seq_lens - 1
    return extend_attention_reference(
        q, k_pool, v_pool, page_table, table_idx, prefix_lens, seq_lens, scale, k_scale, v_scale, window
    )
