"""The torch backend's faster CPU prefill, for `--quantization` models only.

The default float32 model keeps `TorchAttentionBackend`'s plain per-request prefill (repeated
K/V heads, one matmul pair per request) so that its prompt log-likelihoods stay bit-identical;
a quantized model (whose numerics already differ by far more than float rounding) gets this
subclass, picked by the engine from the flag that `quantize_model` sets. Prefill here runs one
baddbmm/softmax/bmm per KV head whose query heads share the head's K/V by broadcast (no
repeat_interleave copy), with an additive causal mask built once per pass rather than per
layer: query j of a request whose prefix holds p tokens sees keys [0, p + j] (1.4 vs 2.4 ms per
layer at 256 tokens on one thread; torch's SDPA took 3.0).

Decode is the plain backend's for both: over a head-major pool it measured as fast as SDPA
(docs/BENCHMARKS.md, CPU decode attention at long contexts).
"""

from __future__ import annotations

import torch

from minfer.attention.base import AttentionMetadata, ForwardContext
from minfer.attention.torch_backend import TorchAttentionBackend


class FastTorchAttentionBackend(TorchAttentionBackend):
    name = "torch-fast"

    def __init__(self):
        super().__init__()
        self._masks_of: AttentionMetadata | None = None
        self._masks: dict[tuple[int, int | None], torch.Tensor] = {}

    # TorchAttentionBackend.forward dispatches decode to its own _decode, prefill to this.
    def _per_request(
        self, q: torch.Tensor, layer: int, ctx: ForwardContext, scale: float, window=None
    ) -> torch.Tensor:
        meta = ctx.attn
        if self._masks_of is not meta:  # one causal mask per request (and window) per pass, not per layer
            self._masks_of, self._masks = meta, {}
        num_kv_heads = ctx.kv_pool.num_kv_heads
        group = q.shape[1] // num_kv_heads
        out = torch.empty_like(q)
        for i, start, prefix, extend, k, v in self.requests_kv(ctx, layer):
            seq = prefix + extend
            k, v = k.float(), v.float()  # [S, Hk, D]
            mask = self._masks.get((i, window))
            if mask is None:
                visible = self.visible_keys(extend, seq, window, q.device)
                mask = torch.zeros(extend, seq, device=q.device).masked_fill_(~visible, float("-inf"))
                self._masks[i, window] = mask
            rows = q[start : start + extend].float()
            # Per KV head, its `group` query heads are the batch of one baddbmm against the
            # head's K/V slice, broadcast (stride 0) rather than repeat_interleave'd.
            for h in range(num_kv_heads):
                heads = slice(h * group, (h + 1) * group)
                kt = k[:, h].t().expand(group, -1, -1)  # [G, D, S]
                scores = torch.baddbmm(mask, rows[:, heads].transpose(0, 1), kt, alpha=scale)  # [G, E, S]
                o = torch.bmm(scores.softmax(dim=-1), v[:, h].expand(group, -1, -1))  # [G, E, D]
                out[start : start + extend, heads] = o.transpose(0, 1).to(q.dtype)
        return out
