"""Reference attention backend in plain torch: runs on CPU and CUDA.

It is the yardstick the Triton kernels are checked against, so it favours obviousness
over speed: gather K/V through the page table, then softmax(q k^T) v in float32 with a
causal mask shifted by the cached prefix. (Plain matmuls rather than torch's SDPA: on CPU,
SDPA costs ~5 ms per call at decode shapes on a loaded machine.)

Prefill goes one request at a time in transformers' eager form, with its bits, its scores
scaled, masked and softmaxed in place; on a CPU thread alone, in blocks of query rows whose
scores stay in cache (2.5x faster at 2,048 tokens). Decode, which on CPU runs every step for
the whole batch, goes in one set of batched matmuls over the batch's page-table rows padded to
the longest sequence (padding keys masked out), so its cost does not grow with Python work per
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

    # Prefill's query rows per block on one thread (see _per_request): [Hq, 128, S] scores
    # stay in cache between the matmul that writes them and the softmax and matmul that read them.
    ROWS = 128
    # No matmul narrower than this (rows of a block, keys scored): MKL takes other code paths,
    # which round differently, below 4 rows and below 12 columns.
    MIN_BLOCK = 64

    def _per_request(
        self, q: torch.Tensor, layer: int, ctx: ForwardContext, scale: float, window=None
    ) -> torch.Tensor:
        """Prefill, one request at a time, equal bit for bit to transformers' eager attention
        (repeat K/V over the group, matmul, * scale, mask, softmax, matmul). On one thread the
        query rows go in blocks of about ROWS, which leaves every score, probability and output
        as it was: each row's matmuls and softmax never mix rows, and MKL computes a row alike
        at any row count of at least 4 (tests/attention/test_prefill_chunked_bits.py). With more
        threads MKL splits a matmul's rows among them, so blocks could change its rounding:
        there each request is one block, the eager form's shapes exactly."""
        num_heads, num_kv_heads = q.shape[1], ctx.kv_pool.num_kv_heads
        group = num_heads // num_kv_heads
        # Blocks only where checked bit for bit: on CUDA cuBLAS may pick its kernels by shape.
        one_thread = q.device.type == "cpu" and torch.get_num_threads() == 1
        out = torch.empty_like(q)
        for _, start, prefix, extend, k, v in self.requests_kv(ctx, layer):
            seq = prefix + extend
            if group > 1:
                k = k.repeat_interleave(group, dim=0)
                v = v.repeat_interleave(group, dim=0)
            k, v = k.float(), v.float()
            qi = q[start : start + extend].transpose(0, 1).float()  # [Hq, E, D]
            # Blocks of near-equal size, so that none is narrow (see MIN_BLOCK).
            blocks = -(-extend // self.ROWS) if one_thread else 1
            bounds = [extend * i // blocks for i in range(blocks + 1)]
            scores_buf = torch.empty(num_heads * -(-extend // blocks) * seq, device=q.device)
            for r0, r1 in zip(bounds[:-1], bounds[1:]):
                scores = scores_buf[: num_heads * (r1 - r0) * seq].view(num_heads, r1 - r0, seq)
                self._block_scores(scores, qi[:, r0:r1], k, scale, prefix + r0, window, one_thread)
                torch.softmax(scores, dim=-1, out=scores)  # row by row, so in place is the same
                o = torch.matmul(scores, v)  # the full key range: a shorter sum could round otherwise
                out[start + r0 : start + r1] = o.transpose(0, 1)  # .to(q.dtype) by the copy
        return out

    def _block_scores(self, scores, q, k, scale, first, window, one_thread):
        """q k^T * scale of a block of query rows ([Hq, R, D], the first at position `first`)
        into scores [Hq, R, S], -inf at the keys each row does not see. The mask is applied by
        column ranges: all -inf left of the keys any row sees (the window) and right of them
        (causal), the per-row mask only over the two bands where the block's rows disagree
        (masked_fill_ of the whole [R, S] cost 4x more than the matmul's writes)."""
        rows, seq = scores.shape[1], scores.shape[2]
        lo = 0 if window is None else max(first - window + 1, 0)  # keys any row sees: [lo, hi)
        hi = first + rows
        if one_thread and rows >= self.MIN_BLOCK and hi - lo >= self.MIN_BLOCK and hi - lo < seq:
            # Score only the keys the block sees (half the causal matmul's work). A matmul's
            # element is its row of q against its key, whatever the other keys; into a buffer
            # of its own, as a contiguous output takes the same MKL call as the full-width one.
            seen = torch.matmul(q, k[:, lo:hi].transpose(1, 2))
            torch.mul(seen, scale, out=scores[..., lo:hi])
        else:
            torch.matmul(q, k.transpose(1, 2), out=scores).mul_(scale)
        scores[..., :lo].fill_(float("-inf"))
        scores[..., hi:].fill_(float("-inf"))
        bands = [(first + 1, hi)]  # causal: row j sees keys up to first + j
        if window is not None:  # row j sees keys from first + j - window + 1
            bands.append((lo, first + rows - window))
        for c0, c1 in bands:
            c0, c1 = max(c0, lo), min(c1, hi)
            if c0 < c1:
                position = torch.arange(first, hi, device=q.device).unsqueeze(1)
                key = torch.arange(c0, c1, device=q.device)
                hidden = key > position
                if window is not None:
                    hidden |= key <= position - window
                scores[..., c0:c1].masked_fill_(hidden, float("-inf"))
