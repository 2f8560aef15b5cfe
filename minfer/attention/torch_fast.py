"""The torch backend with its prefill through SDPA: `--attention-backend sdpa`, and what
`--quantization` models get by default.

The default float32 model keeps `TorchAttentionBackend`'s plain per-request prefill (repeated
K/V heads, one matmul pair per request) so that its prompt log-likelihoods stay bit-identical
to transformers' eager attention; this path's equal transformers' sdpa attention (its default)
bit for bit, at most ~3e-5 nats from eager (scripts/default_model_prefill_parity.py), which a
user may prefer for long prompts. A quantized model, whose numerics already differ by far more
than float rounding, gets this subclass unless told otherwise (attention/choice.py).

Prefill here is torch's SDPA per request: grouped query heads share their KV head (enable_gqa,
no repeat_interleave copy), and a request's causal mask, aligned at its last key (query j of a
request whose prefix holds p tokens sees keys [0, p + j]), is `causal_lower_right`, which the
CPU flash kernel applies by skipping the masked blocks instead of reading a mask; a sliding
window that binds passes its visible keys as a boolean mask. One thread, the default model's
heads, ms per layer against the per-KV-head baddbmm/softmax/bmm it replaced
(scripts/cpu_attention_bench.py --prefill): 2,048 fresh tokens 76 vs 363; 1,024 after a
1,024-token prefix 70 vs 110; 256 fresh 2.1 vs 2.5 (docs/BENCHMARKS.md, CPU prefill attention).

Decode is the plain backend's for both: over a head-major pool it measured as fast as SDPA
(docs/BENCHMARKS.md, CPU decode attention at long contexts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from minfer.attention.base import AttentionMetadata, ForwardContext
from minfer.attention.torch_backend import TorchAttentionBackend


class FastTorchAttentionBackend(TorchAttentionBackend):
    name = "sdpa"

    def __init__(self):
        super().__init__()
        self._masks_of: AttentionMetadata | None = None
        self._masks: dict[tuple[int, int], torch.Tensor] = {}  # by (request, window): keys it sees

    # TorchAttentionBackend.forward dispatches decode to its own _decode, prefill to this.
    def _per_request(
        self, q: torch.Tensor, layer: int, ctx: ForwardContext, scale: float, window=None
    ) -> torch.Tensor:
        meta = ctx.attn
        if self._masks_of is not meta:  # one window mask per request per pass, not per layer
            self._masks_of, self._masks = meta, {}
        out = torch.empty_like(q)
        for i, start, prefix, extend, k, v in self.requests_kv(ctx, layer):
            seq = prefix + extend
            if window is None or seq <= window:
                # Query j sees keys [0, prefix + j]: causal, aligned at the last key, which SDPA's
                # flash kernel applies by skipping the blocks above the diagonal.
                mask = causal_lower_right(extend, seq)
            else:
                mask = self._masks.get((i, window))
                if mask is None:
                    mask = self._masks[i, window] = self.visible_keys(extend, seq, window, q.device)
            rows = q[start : start + extend].float().transpose(0, 1)  # [Hq, E, D]
            o = F.scaled_dot_product_attention(
                rows.unsqueeze(0),
                k.float().unsqueeze(0),
                v.float().unsqueeze(0),
                attn_mask=mask,
                scale=scale,
                enable_gqa=True,
            )  # [1, Hq, E, D]; enable_gqa: each KV head serves its query heads without a copy
            out[start : start + extend] = o[0].transpose(0, 1).to(q.dtype)
        return out
