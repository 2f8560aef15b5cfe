"""The torch backend's faster CPU path, for `--quantization` models only.

The default float32 model keeps `TorchAttentionBackend`'s plain matmuls so that its
log-likelihoods stay bit-identical; a quantized model (whose numerics already differ by
far more than float rounding) gets this subclass, picked by the engine from the flag that
`quantize_model` sets. Same semantics, three changes that measured faster on one thread
(SmolLM2-135M shapes, see docs/BENCHMARKS.md's CPU section):

- prefill in one baddbmm/softmax/bmm per KV head whose query heads share the head's K/V by
  broadcast (no repeat_interleave copy), with an additive causal mask built once per pass
  rather than per layer: query j of a request whose prefix holds p tokens sees keys
  [0, p + j] (1.4 vs 2.4 ms per layer at 256 tokens; torch's SDPA took 3.0 on one thread);
- a lone request whose slots are one ascending run (a lone stream's usual layout) decodes
  over a view of the pool, with no gather copy at all, in two bmm per pass and layer: SDPA's
  set-up cost there is most of the work (batch-1 decode step 20.0 -> 18.7 ms, process time,
  scripts/cpu_quant_ab.py);
- otherwise decode runs `F.scaled_dot_product_attention` (enable_gqa; at 16 requests 3x
  faster than 4-D matmuls) over K/V gathered into buffers kept across steps and layers: a
  fresh multi-MB tensor per layer cost more in page faults than the copy itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minfer.attention.base import AttentionMetadata, ForwardContext
from minfer.attention.torch_backend import DecodePlan, TorchAttentionBackend


class FastDecodePlan(DecodePlan):
    """DecodePlan plus, where every request's slots are one ascending run, each run's
    (first slot, length): the layers then read K/V in place."""

    def __init__(self, meta: AttentionMetadata, window: int | None = None):
        super().__init__(meta, window)
        self.runs: list[tuple[int, int]] | None = None
        if meta.batch_size == 1:  # per-request views cost a Python loop; worth it for one
            length = self.longest
            slots = self.rows[0]
            first = int(slots[0])
            if int(slots[-1]) - first == length - 1 and bool((slots.diff() == 1).all()):
                if window is not None and length > window:  # only the window's keys: the run's end
                    first, length = first + length - window, window
                self.runs = [(first, length)]
        self.attn_mask = self.mask.view(meta.batch_size, 1, 1, self.longest)


class FastTorchAttentionBackend(TorchAttentionBackend):
    name = "torch-fast"
    plan_type = FastDecodePlan

    def __init__(self):
        super().__init__()
        self._k_buf = self._v_buf = torch.empty(0)
        self._masks_of: AttentionMetadata | None = None
        self._masks: dict[tuple[int, int | None], torch.Tensor] = {}

    # TorchAttentionBackend.forward dispatches to these two: a decode pass, a prefill pass.
    def _decode(
        self, q: torch.Tensor, layer: int, ctx: ForwardContext, scale: float, window=None
    ) -> torch.Tensor:
        plan = self.decode_plan(ctx.attn, window)
        pool = ctx.kv_pool
        batch, num_heads, head_dim = q.shape
        if plan.runs is not None and not pool.quantized and q.dtype == pool.k[layer].dtype == torch.float32:
            first, length = plan.runs[0]
            run = slice(first, first + length)
            return self._lone_stream(q, pool.k[layer][run], pool.v[layer][run], scale)
        k, v = self._gather(pool, layer, plan.slots)
        k = k.view(batch, plan.longest, pool.num_kv_heads, head_dim)
        v = v.view(batch, plan.longest, pool.num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(
            q.float().unsqueeze(2),  # [B, Hq, 1, D]
            k.float().transpose(1, 2),  # [B, Hk, S, D], a strided view
            v.float().transpose(1, 2),
            attn_mask=plan.attn_mask,
            scale=scale,
            enable_gqa=True,
        )
        return out.view(batch, num_heads, head_dim).to(q.dtype)

    @staticmethod
    def _lone_stream(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """One request's decode over its K/V run [S, Hk, D], read in place: per KV head, its
        query heads against the run's keys in two bmm (BLAS reads the strided K/V views as
        they are). 25 vs 32 us per call for SDPA at 300 keys (one thread)."""
        _, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        grouped = q.view(num_kv_heads, num_heads // num_kv_heads, head_dim)  # [Hk, G, D]
        scores = torch.bmm(grouped, k.permute(1, 2, 0)).mul_(scale)  # [Hk, G, S]
        out = torch.bmm(scores.softmax(dim=-1), v.transpose(0, 1))  # [Hk, G, D]
        return out.view(1, num_heads, head_dim)

    def _gather(self, pool, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if pool.quantized:  # fp8 storage dequantizes into new tensors anyway
            return pool.gather(layer, slots)
        shape = (slots.numel(), *pool.k[layer].shape[1:])
        size = shape[0] * shape[1] * shape[2]
        if self._k_buf.numel() < size or self._k_buf.dtype != pool.k[layer].dtype:
            # Grown to the largest batch seen, never shrunk: a steady load reuses it.
            self._k_buf = torch.empty(size, dtype=pool.k[layer].dtype, device=slots.device)
            self._v_buf = torch.empty_like(self._k_buf)
        k = torch.index_select(pool.k[layer], 0, slots, out=self._k_buf[:size].view(shape))
        v = torch.index_select(pool.v[layer], 0, slots, out=self._v_buf[:size].view(shape))
        return k, v

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
