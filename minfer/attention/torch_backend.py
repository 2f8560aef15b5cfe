"""Reference attention backend in plain torch: runs on CPU and CUDA.

It is the yardstick the Triton kernels are checked against, so it favours obviousness
over speed: gather K/V through the page table, then softmax(q k^T) v in float32 with a
causal mask shifted by the cached prefix. (Plain matmuls rather than torch's SDPA: on CPU,
SDPA costs ~5 ms per call at decode shapes on a loaded machine.)

Prefill goes one request at a time. Decode, which on CPU runs every step for the whole
batch, goes in one set of batched matmuls over the batch's page-table rows padded to the
longest sequence (padding keys masked out), so its cost does not grow with Python work per
request: the per-request loop cost ~0.1 ms per request per layer, 0.2 s per step at 64
requests on the default model's 30 layers. Grouped-query heads share their K/V through the
matmul's shape rather than a repeat_interleave copy (at batch 1 and 450 cached tokens that
copy was ~60 MB per step on the default model, more than its 4-bit weights).
"""

from __future__ import annotations

import torch

from minfer.attention.base import AttentionMetadata, ForwardContext


class DecodePlan:
    """What every layer's decode attention of one pass shares (per sliding window, if a layer
    has one): the batch's K/V slots [B, S_max] (padding points at each request's first slot,
    which holds real, finite K/V) and the additive mask [B, 1, S_max] (0 for a key, -inf for
    padding and for keys before the window)."""

    def __init__(self, meta: AttentionMetadata, window: int | None = None):
        seq_lens = meta.seq_lens.long()
        longest = int(max(p + e for p, e in zip(meta.prefix_lens_cpu, meta.extend_lens_cpu)))
        rows = meta.page_table.index_select(0, meta.table_idx.long())[:, :longest].long()
        positions = torch.arange(longest, device=rows.device)
        visible = positions.unsqueeze(0) < seq_lens.unsqueeze(1)  # [B, S_max]
        if window is not None:  # the new token at seq_len - 1 sees keys [seq_len - window, seq_len)
            visible &= positions.unsqueeze(0) >= (seq_lens - window).unsqueeze(1)
        self.meta = meta
        self.rows = rows  # [B, S_max] every position's slot, padding and keys before a window too
        self.slots = torch.where(visible, rows, rows[:, :1]).reshape(-1)
        self.mask = torch.zeros(visible.shape, dtype=torch.float32, device=rows.device)
        self.mask.masked_fill_(~visible, float("-inf"))
        self.mask = self.mask.view(len(seq_lens), 1, longest)
        self.longest = longest


class TorchAttentionBackend:
    name = "torch"
    plan_type = DecodePlan
    writes_new_kv = False  # the model (or layers/attention.py on CUDA) stores the pass's K/V first

    def __init__(self):
        self._plans: dict[int | None, DecodePlan] = {}  # of the current pass, by sliding window

    def decode_plan(self, meta: AttentionMetadata, window: int | None = None) -> DecodePlan:
        """The pass's plan: built by its first layer (of this window), shared by the others."""
        plan = self._plans.get(window)
        if plan is None or plan.meta is not meta:
            plan = self._plans[window] = self.plan_type(meta, window)
        return plan

    @staticmethod
    def visible_keys(extend: int, seq: int, window: int | None, device) -> torch.Tensor:
        """[extend, seq] bool: query j sits at position prefix + j (prefix = seq - extend) and
        sees keys [0, prefix + j], or with a window only (prefix + j - window, prefix + j]."""
        prefix = seq - extend
        visible = torch.ones(extend, seq, dtype=torch.bool, device=device).tril(diagonal=prefix)
        if window is not None:
            visible = visible.triu(diagonal=prefix - window + 1)
        return visible

    @staticmethod
    def requests_kv(ctx: ForwardContext, layer: int):
        """Per request of a prefill pass: (index, first query row, prefix, extend, k, v), with
        k, v [prefix + extend, Hk, D] gathered through its page-table row."""
        meta = ctx.attn
        start = 0
        table_idx = meta.table_idx.tolist() if meta.table_idx.device.type != "cpu" else meta.table_idx
        for i, (prefix, extend) in enumerate(zip(meta.prefix_lens_cpu, meta.extend_lens_cpu)):
            slots = meta.page_table[int(table_idx[i]), : prefix + extend].long()
            k, v = ctx.kv_pool.gather(layer, slots)
            yield i, start, prefix, extend, k, v
            start += extend

    def forward(
        self, q: torch.Tensor, layer: int, ctx: ForwardContext, scale: float, new_kv=None, window=None
    ) -> torch.Tensor:
        assert new_kv is None, "this backend expects the pass's K/V in the pool (writes_new_kv is False)"
        if ctx.attn.is_decode:
            return self._decode(q, layer, ctx, scale, window)
        return self._per_request(q, layer, ctx, scale, window)

    def _decode(
        self, q: torch.Tensor, layer: int, ctx: ForwardContext, scale: float, window=None
    ) -> torch.Tensor:
        plan = self.decode_plan(ctx.attn, window)
        batch, num_heads, head_dim = q.shape
        num_kv_heads = ctx.kv_pool.num_kv_heads
        group = num_heads // num_kv_heads
        k, v = ctx.kv_pool.gather(layer, plan.slots)  # [B * S, Hk, D]
        k = k.view(batch, plan.longest, num_kv_heads, head_dim).float()
        v = v.view(batch, plan.longest, num_kv_heads, head_dim).float()
        # Each KV head serves `group` query heads: the group is the matmul's row dim (no copy
        # of K/V). One bmm pair per KV head on [B, S, D] slices that BLAS reads in place with a
        # row stride of Hk * D: permuting all heads into one 4-D matmul made torch copy K and V
        # first (2.2x slower at batch 16, 320 cached tokens, 3 KV heads).
        qg = q.reshape(batch, num_kv_heads, group, head_dim).float()
        out = torch.empty(batch, num_kv_heads, group, head_dim, dtype=torch.float32, device=q.device)
        for h in range(num_kv_heads):
            scores = torch.baddbmm(plan.mask, qg[:, h], k[:, :, h].transpose(1, 2), alpha=scale)  # [B, G, S]
            torch.bmm(scores.softmax(dim=-1), v[:, :, h], out=out[:, h])
        return out.view(batch, num_heads, head_dim).to(q.dtype)

    def _per_request(
        self, q: torch.Tensor, layer: int, ctx: ForwardContext, scale: float, window=None
    ) -> torch.Tensor:
        num_heads, num_kv_heads = q.shape[1], ctx.kv_pool.num_kv_heads
        group = num_heads // num_kv_heads
        out = torch.empty_like(q)
        for _, start, prefix, extend, k, v in self.requests_kv(ctx, layer):
            seq = prefix + extend
            k, v = k.transpose(0, 1), v.transpose(0, 1)  # [Hk, S, D]
            if group > 1:
                k = k.repeat_interleave(group, dim=0)
                v = v.repeat_interleave(group, dim=0)
            qi = q[start : start + extend].transpose(0, 1)  # [Hq, E, D]
            scores = torch.matmul(qi.float(), k.float().transpose(1, 2)) * scale  # [Hq, E, S]
            if extend > 1 or (window is not None and seq > window):
                scores = scores.masked_fill(~self.visible_keys(extend, seq, window, q.device), float("-inf"))
            o = torch.matmul(scores.softmax(dim=-1), v.float()).to(q.dtype)
            out[start : start + extend] = o.transpose(0, 1)
        return out
