"""Reference attention backend in plain torch: runs on CPU and CUDA, one request at a time.

It is the yardstick the Triton kernels are checked against, so it favours obviousness
over speed: gather the request's K/V through its page-table row, then softmax(q k^T) v in
float32 with a causal mask shifted by the cached prefix. (Plain matmuls rather than torch's
SDPA: on CPU, SDPA costs ~5 ms per call at decode shapes on a loaded machine.)
"""

from __future__ import annotations

import torch

from minfer.attention.base import ForwardContext


class TorchAttentionBackend:
    name = "torch"

    def forward(self, q: torch.Tensor, layer: int, ctx: ForwardContext, scale: float) -> torch.Tensor:
        meta = ctx.attn
        num_heads, num_kv_heads = q.shape[1], ctx.kv_pool.num_kv_heads
        group = num_heads // num_kv_heads
        out = torch.empty_like(q)
        start = 0
        table_idx = meta.table_idx.tolist() if meta.table_idx.device.type != "cpu" else meta.table_idx
        for i, (prefix, extend) in enumerate(zip(meta.prefix_lens_cpu, meta.extend_lens_cpu)):
            seq = prefix + extend
            slots = meta.page_table[int(table_idx[i]), :seq].long()
            k, v = ctx.kv_pool.gather(layer, slots)
            k, v = k.transpose(0, 1), v.transpose(0, 1)  # [Hk, S, D]
            if group > 1:
                k = k.repeat_interleave(group, dim=0)
                v = v.repeat_interleave(group, dim=0)
            qi = q[start : start + extend].transpose(0, 1)  # [Hq, E, D]
            scores = torch.matmul(qi.float(), k.float().transpose(1, 2)) * scale  # [Hq, E, S]
            if extend > 1:  # query j sits at position prefix + j and sees keys [0, prefix + j]
                visible = torch.ones(extend, seq, dtype=torch.bool, device=q.device).tril(diagonal=prefix)
                scores = scores.masked_fill(~visible, float("-inf"))
            o = torch.matmul(scores.softmax(dim=-1), v.float()).to(q.dtype)
            out[start : start + extend] = o.transpose(0, 1)
            start += extend
        return out
