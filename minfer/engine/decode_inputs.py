"""A decode step's per-request vectors, staged to the device in one copy.

A decode step needs a few small vectors on the device: each request's page-table row, the
sequence length after the step (with the rows, the attention metadata), the position of its new
token, the KV slot that token's K/V goes to, the position its sampled token lands at (the
sampler's noise reads it), and where in the flattened token table the input token is read and
the sampled one written. They are all known on the host before the step starts, so they travel
as one [7, width] int64 copy instead of five (each a pinned staging plus a copy of a few dozen
bytes, tens of microseconds of host time; at batch 1 the host's work is what bounds the step:
docs/PERFORMANCE.md, section 20), and the table indices need no arithmetic on the device (five
launches fewer a step). The step also writes the new slots into the device page table from
here (`DecodeInputs.start`, one kernel with the input-token gather), instead of a copy of its
own at allocation.

When the step replays a CUDA graph, the copy goes straight into the graph's input buffer (the
graph reads its vectors from there: engine/cuda_graph.py), `width` is the graph's padded batch
size, and the padding columns hold what its padding rows need (the padding page-table row,
sequence length 1, the pool's scratch slot for their K/V, and for the token the graph draws the
padding row's own entry of the token table), so the device fills nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minfer.core import Req
from minfer.device import to_device
from minfer.kvcache.page_table import PageTable

# The rows of the staged [7, width] tensor.
TABLE_IDX, SEQ_LENS, POSITIONS, OUT_LOC, INPUT_AT, SAMPLED_AT, SAMPLED_TO = range(7)


def _row(index: int, doc: str, requests_only: bool = False) -> property:
    """Row `index` of DecodeInputs.staged: every column, or the first n (the requests')."""
    if requests_only:
        return property(lambda self: self.staged[index, : self.n], doc=doc)
    return property(lambda self: self.staged[index], doc=doc)


@dataclass
class DecodeInputs:
    n: int  # the requests of the step; columns past it are the graph's padding
    staged: torch.Tensor  # [7, width] int64 on the device, the rows named above

    table_idx = _row(TABLE_IDX, "[width] each request's page-table row")
    seq_lens = _row(SEQ_LENS, "[width] its length after this step")
    positions = _row(POSITIONS, "[width] the position of its new token (its cached length)")
    out_loc = _row(OUT_LOC, "[width] the KV slot of that token")
    input_at = _row(INPUT_AT, "[width] that position's index in the flattened page and token tables")
    sampled_at = _row(SAMPLED_AT, "[n] the position of the token it samples (its device_len)", True)
    sampled_to = _row(SAMPLED_TO, "[n] that position's index in the flattened token table", True)

    @property
    def meta(self) -> torch.Tensor:
        """[2, width]: table_idx and seq_lens, the decode graph's attention metadata."""
        return self.staged[TABLE_IDX : SEQ_LENS + 1]

    def start(self, page_table: PageTable, meta: torch.Tensor | None = None) -> torch.Tensor:
        """The step's input token ids [width] int64, read from the token table, after recording
        each request's new slot in the device page table (its host mirror was written when the
        slots were allocated: KVManager.allocate with write_device=False), and with `meta` (a
        graph's int32 [2, >= width] attention metadata) holding the step's `meta`. A padding
        column writes the scratch slot into the padding row, which already holds it. One kernel
        on CUDA (minfer.kernels.decode_step), the same steps as torch ops elsewhere."""
        if self.staged.is_cuda:
            from minfer.kernels.decode_step import decode_step_inputs

            slots = page_table.slots if page_table.mirrored else None
            rows = (TABLE_IDX, SEQ_LENS, OUT_LOC, INPUT_AT)
            return decode_step_inputs(self.staged, rows, slots, page_table.tokens, meta)
        if page_table.mirrored:
            page_table.write_slots_at(self.input_at, self.out_loc)
        if meta is not None:
            meta[:, : self.staged.shape[1]].copy_(self.meta)
        return page_table.tokens_at(self.input_at).long()


def padding_columns(width: int, page_table: PageTable, scratch_slot: int) -> list[list[int]]:
    """What the staged rows hold in a graph's padding columns: the padding page-table row,
    sequence length 1, the scratch slot for the K/V, and position 0 of the padding row, which
    the input is read from and the drawn token written to (never a real request's entry)."""
    flat = page_table.flat_index(page_table.padding_row, 0)
    return [[v] * width for v in (page_table.padding_row, 1, 0, scratch_slot, flat, 0, flat)]


def stage_decode_inputs(
    reqs: list[Req],
    out_loc: list[int],
    width: int,
    page_table: PageTable,
    scratch_slot: int,
    device: torch.device,
    into: torch.Tensor | None = None,
) -> DecodeInputs:
    """The step's vectors for `reqs` (a decode batch, in its order) padded to `width` columns,
    copied into the first `width` columns of `into` ([7, >= width] int64 on `device`: a
    decode graph's input buffer) or into a new tensor."""
    pad = padding_columns(width - len(reqs), page_table, scratch_slot)
    rows = [r.table_idx for r in reqs]
    positions = [r.cached_len for r in reqs]
    sampled_at = [r.device_len for r in reqs]
    flat = page_table.flat_index
    host = [
        rows,
        [p + 1 for p in positions],
        positions,
        list(out_loc),
        list(map(flat, rows, positions)),
        sampled_at,
        list(map(flat, rows, sampled_at)),
    ]
    host = [real + padding for real, padding in zip(host, pad)]
    out = None if into is None else into[:, :width]
    return DecodeInputs(len(reqs), to_device(host, torch.int64, device, out))
