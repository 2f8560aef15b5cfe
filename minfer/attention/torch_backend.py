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
copy was ~60 MB per step on the default model, more than its 4-bit weights). On the CPU the
pool is head-major (KVPool), so each (KV head, request) pair's keys are one contiguous matrix;
a lone request whose slots are one run is read in place, without a gather.
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
        # A lone request whose slots are one ascending run (a lone stream's usual layout): the
        # (first slot, length) of the keys it sees, which the layers read in place, no gather.
        self.run: tuple[int, int] | None = None
        if meta.batch_size == 1:  # per-request runs would cost a Python loop; worth it for one
            slots = rows[0]
            first = int(slots[0])
            if int(slots[-1]) - first == longest - 1 and bool((slots.diff() == 1).all()):
                if window is not None and longest > window:  # only the window's keys: the run's end
                    first, longest = first + longest - window, window
                self.run = (first, longest)
        self._head_mask: torch.Tensor | None = None

    def head_mask(self, num_kv_heads: int) -> torch.Tensor:
        """The mask repeated per KV head, [Hk * B, 1, S_max], for matmuls batched over both
        (built by the pass's first layer, shared by the others)."""
        if self._head_mask is None:
            self._head_mask = self.mask.repeat(num_kv_heads, 1, 1)
        return self._head_mask


class TorchAttentionBackend:
    name = "torch"
    plan_type = DecodePlan
    writes_new_kv = False  # the model (or layers/attention.py on CUDA) stores the pass's K/V first

    def __init__(self):
        self._plans: dict[int | None, DecodePlan] = {}  # of the current pass, by sliding window
        self._k_buf = self._v_buf = torch.empty(0)  # decode's gathered K/V (see _gather)

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
        k, v [Hk, prefix + extend, D] gathered head first through its page-table row."""
        meta = ctx.attn
        start = 0
        table_idx = meta.table_idx.tolist() if meta.table_idx.device.type != "cpu" else meta.table_idx
        for i, (prefix, extend) in enumerate(zip(meta.prefix_lens_cpu, meta.extend_lens_cpu)):
            slots = meta.page_table[int(table_idx[i]), : prefix + extend].long()
            k, v = ctx.kv_pool.gather_heads(layer, slots)
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
        pool = ctx.kv_pool
        batch, num_heads, head_dim = q.shape
        num_kv_heads = pool.num_kv_heads
        k, v, mask = self.heads_kv(pool, layer, plan)  # [Hk, B * S, D]; mask None: all visible
        keys = k.shape[1] // batch
        k, v = k.view(num_kv_heads * batch, keys, head_dim), v.view(num_kv_heads * batch, keys, head_dim)
        # Each KV head serves `group` query heads: they are the rows of its matmul, and (head,
        # request) pairs the batch of ONE baddbmm and ONE bmm per layer, over K/V laid out head
        # first so that BLAS reads each pair's keys as one contiguous matrix (no K/V copy for
        # the grouped heads; twice as fast as over slot-major rows at long contexts).
        qg = (
            q.view(batch, num_kv_heads, -1, head_dim)
            .transpose(0, 1)
            .reshape(num_kv_heads * batch, -1, head_dim)
        )
        if mask is None:
            scores = torch.bmm(qg.float(), k.transpose(1, 2)).mul_(scale)
        else:
            scores = torch.baddbmm(mask, qg.float(), k.transpose(1, 2), alpha=scale)
        out = torch.bmm(scores.softmax(dim=-1), v)  # [Hk * B, G, D]
        return out.view(num_kv_heads, batch, -1, head_dim).transpose(0, 1).reshape(q.shape).to(q.dtype)

    def heads_kv(self, pool, layer: int, plan: DecodePlan):
        """The pass's K and V head first, [Hk, B * S, D] float32, and the additive mask over
        them ([Hk * B, 1, S]; None where every key is visible): a lone run read in place (a view
        of the pool, only the keys it sees), otherwise gathered through the plan's slots."""
        # In place only where nothing needs converting: the matmuls run in float32.
        if plan.run is not None and not pool.quantized and pool.k[layer].dtype == torch.float32:
            keys = slice(plan.run[0], plan.run[0] + plan.run[1])
            k, v = pool.heads(layer)
            return k[:, keys], v[:, keys], None
        k, v = self._gather(pool, layer, plan.slots)
        return k.float(), v.float(), plan.head_mask(pool.num_kv_heads)

    def _gather(self, pool, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `slots` head first, [Hk, S, D], copied into buffers kept across layers and
        steps: a fresh multi-MB tensor per layer cost more in page faults than the copy itself."""
        shape = (pool.num_kv_heads, slots.numel(), pool.head_dim)
        size = shape[0] * shape[1] * shape[2]
        if self._k_buf.numel() < size or self._k_buf.dtype != pool.storage_dtype:
            # Grown to the largest batch seen, never shrunk: a steady load reuses it.
            self._k_buf = torch.empty(size, dtype=pool.storage_dtype, device=slots.device)
            self._v_buf = torch.empty_like(self._k_buf)
        return pool.gather_heads(
            layer, slots, out=(self._k_buf[:size].view(shape), self._v_buf[:size].view(shape))
        )

    def _per_request(
        self, q: torch.Tensor, layer: int, ctx: ForwardContext, scale: float, window=None
    ) -> torch.Tensor:
        num_heads, num_kv_heads = q.shape[1], ctx.kv_pool.num_kv_heads
        group = num_heads // num_kv_heads
        out = torch.empty_like(q)
        for _, start, prefix, extend, k, v in self.requests_kv(ctx, layer):
            seq = prefix + extend
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
