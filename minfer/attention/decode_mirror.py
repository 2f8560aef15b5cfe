"""A padded, per-page-table-row copy of the running requests' K/V, kept up to date one token
per decode step, so that batched CPU decode reads K/V in place instead of gathering it.

With one-slot pages, concurrent decoders' new tokens interleave in the pool, so a batch's
K/V has to be gathered into a [B, S, Hk, D] tensor every layer of every step: at batch 16
and ~300 cached tokens that copy cost about as much as the attention itself (SmolLM2-135M,
one thread). The mirror keeps that tensor between steps: row r holds, for positions
[0, valid[r]), the K/V of the request on page-table row r. A decode step appends each
request's newest token (B rows per layer); a row whose request is new (valid was reset by a
prefill pass, which every request goes through on its way in) is refilled from the pool.
Used only while it fits in `budget_bytes` and while the batch's rows are a dense range.
"""

from __future__ import annotations

import torch

from minfer.attention.base import AttentionMetadata
from minfer.kvcache.pool import KVPool

ROW_STEP, TOKEN_STEP = 8, 128  # grow by these, so a growing load rarely reallocates


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


class DecodeMirror:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.valid: list[int] = []  # per page-table row

    def forget(self, table_idx) -> None:
        """A prefill pass of these rows: their requests may be new, or their K/V rewritten."""
        for row in table_idx:
            if int(row) < len(self.valid):
                self.valid[int(row)] = 0

    def plan(self, meta: AttentionMetadata, pool: KVPool, longest: int) -> MirrorPlan | None:
        """What this decode pass copies and reads, or None where the mirror does not fit."""
        rows = [int(r) for r in meta.table_idx.tolist()]
        lo, hi = min(rows), max(rows) + 1
        if hi - lo > len(rows) + ROW_STEP:  # a sparse batch would read mostly padding
            return None
        if not self._fits(hi, longest, pool):
            return None
        capacity = self.k[0].shape[1]
        dst, src = [], []
        seq_lens = [p + e for p, e in zip(meta.prefix_lens_cpu, meta.extend_lens_cpu)]
        for row, seq in zip(rows, seq_lens):
            start = self.valid[row] if self.valid[row] < seq else 0
            dst.extend(range(row * capacity + start, row * capacity + seq))
            src.extend(meta.page_table[row, start:seq].tolist())
            self.valid[row] = seq
        visible = torch.zeros(hi - lo, longest, dtype=torch.bool)
        visible[:, 0] = True  # rows outside the batch: key 0 (finite) keeps their softmax defined
        for row, seq in zip(rows, seq_lens):
            visible[row - lo, :seq] = True
            visible[row - lo, seq:] = False
        mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
        return MirrorPlan(self, lo, hi, longest, rows, torch.tensor(dst), torch.tensor(src), mask)

    def _fits(self, rows: int, tokens: int, pool: KVPool) -> bool:
        have_rows, have_tokens = (self.k[0].shape[0], self.k[0].shape[1]) if self.k else (0, 0)
        if rows <= have_rows and tokens <= have_tokens:
            return True
        rows, tokens = (
            _round_up(max(rows, have_rows), ROW_STEP),
            _round_up(max(tokens, have_tokens), TOKEN_STEP),
        )
        layer0 = pool.k[0]
        nbytes = 2 * len(pool.k) * rows * tokens * layer0[0].numel() * layer0.element_size()
        if nbytes > self.budget_bytes:
            return False
        # Regrown empty: every row refills from the pool on its next decode step.
        shape = (rows, tokens, *layer0.shape[1:])
        self.k = [torch.zeros(shape, dtype=layer0.dtype) for _ in pool.k]
        self.v = [torch.zeros(shape, dtype=layer0.dtype) for _ in pool.k]
        self.valid = [0] * rows
        return True


class MirrorPlan:
    """One decode pass over the mirror: per layer, copy the pass's new K/V rows in, then read
    rows [lo, hi) as [hi - lo, S, Hk, D] views with `mask` [hi - lo, 1, 1, S]."""

    def __init__(self, mirror, lo, hi, longest, rows, dst, src, mask):
        self.mirror, self.lo, self.hi, self.longest = mirror, lo, hi, longest
        self.batch_rows = torch.tensor(rows) - lo  # the batch's requests within [lo, hi)
        self.dst, self.src = dst, src
        self.mask = mask.view(hi - lo, 1, 1, longest)

    def kv(self, pool: KVPool, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.mirror.k[layer], self.mirror.v[layer]
        flat = (-1, *k.shape[2:])
        k.view(flat).index_copy_(0, self.dst, pool.k[layer].index_select(0, self.src))
        v.view(flat).index_copy_(0, self.dst, pool.v[layer].index_select(0, self.src))
        return k[self.lo : self.hi, : self.longest], v[self.lo : self.hi, : self.longest]
