"""A decode step's per-request vectors, staged to the device in one copy.

A decode step needs a few small vectors on the device: each request's page-table row, the
sequence length after the step (with the rows, the attention metadata), the position of its new
token, the KV slot that token's K/V goes to, the position its sampled token lands at (the
sampler's noise reads it), and where in the flattened token table the input token is read and
the sampled one written. They are all known on the host before the step starts, so they travel
as one [7, width] int64 copy instead of four (each a pinned staging plus a copy of a few dozen
bytes, tens of microseconds of host time; at batch 1 the host's work is what bounds the step:
docs/PERFORMANCE.md, section 20), and the table indices need no arithmetic on the device (five
launches fewer a step).

When the step replays a CUDA graph, `width` is the graph's padded batch size and the padding
columns hold what its padding rows need (the padding page-table row, sequence length 1, the
pool's scratch slot for their K/V), so the device fills nothing. Only the first `n` columns of
`sampled_at` are read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minfer.core import Req
from minfer.device import to_device
from minfer.kvcache.page_table import PageTable


@dataclass
class DecodeInputs:
    n: int  # the requests of the step; columns past it are the graph's padding
    # [2, width]: each request's page-table row and its length after this step, the decode
    # graph's attention metadata (table_idx and seq_lens below)
    meta: torch.Tensor
    positions: torch.Tensor  # [width] the position of its new token (its cached length)
    out_loc: torch.Tensor  # [width] the KV slot of that token
    input_at: torch.Tensor  # [width] that token's index in the flattened token table
    sampled_at: torch.Tensor  # [n] the position of the token it samples (its device_len)
    sampled_to: torch.Tensor  # [n] that position's index in the flattened token table

    @property
    def table_idx(self) -> torch.Tensor:
        return self.meta[0]

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.meta[1]


def stage_decode_inputs(
    reqs: list[Req],
    out_loc: list[int],
    width: int,
    page_table: PageTable,
    scratch_slot: int,
    device: torch.device,
) -> DecodeInputs:
    """The step's vectors for `reqs` (a decode batch, in its order) padded to `width` columns."""
    n = len(reqs)
    pad = width - n
    rows = [r.table_idx for r in reqs]
    positions = [r.cached_len for r in reqs]
    sampled_at = [r.device_len for r in reqs]
    flat = page_table.flat_index
    padding_row = page_table.padding_row
    staged = to_device(
        [
            rows + [padding_row] * pad,
            [p + 1 for p in positions] + [1] * pad,
            positions + [0] * pad,
            list(out_loc) + [scratch_slot] * pad,
            list(map(flat, rows, positions)) + [flat(padding_row, 0)] * pad,
            sampled_at + [0] * pad,
            list(map(flat, rows, sampled_at)) + [0] * pad,
        ],
        torch.int64,
        device,
    )
    positions_d, out_loc_d, input_at, sampled_at_d, sampled_to = staged[2:]
    return DecodeInputs(n, staged[:2], positions_d, out_loc_d, input_at, sampled_at_d[:n], sampled_to[:n])
