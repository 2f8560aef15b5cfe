"""A decode step's per-request vectors, staged to the device in one copy.

A decode step needs five small vectors on the device: each request's page-table row, the
sequence length after the step (with the rows, the attention metadata), the position of its new
token, the KV slot that token's K/V goes to, and the position its sampled token lands at (where
the token table and the sampler's noise read it). They are all known on the host before the
step starts, so they travel as one [5, width] int64 copy instead of four (each a pinned staging
plus a copy of a few dozen bytes, tens of microseconds of host time; at batch 1 the host's work
is what bounds the step: docs/PERFORMANCE.md, section 20).

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


@dataclass
class DecodeInputs:
    n: int  # the requests of the step; columns past it are the graph's padding
    meta: torch.Tensor  # [2, width]: rows 0-1 below, the decode graph's attention metadata
    table_idx: torch.Tensor  # [width] each request's page-table row
    seq_lens: torch.Tensor  # [width] its length after this step
    positions: torch.Tensor  # [width] the position of its new token (its cached length)
    out_loc: torch.Tensor  # [width] the KV slot of that token
    sampled_at: torch.Tensor  # [n] the position of the token it samples (its device_len)


def stage_decode_inputs(
    reqs: list[Req], out_loc: list[int], width: int, padding_row: int, scratch_slot: int, device: torch.device
) -> DecodeInputs:
    """The step's vectors for `reqs` (a decode batch, in its order) padded to `width` columns."""
    n = len(reqs)
    pad = width - n
    positions = [r.cached_len for r in reqs]
    staged = to_device(
        [
            [r.table_idx for r in reqs] + [padding_row] * pad,
            [p + 1 for p in positions] + [1] * pad,
            positions + [0] * pad,
            list(out_loc) + [scratch_slot] * pad,
            [r.device_len for r in reqs] + [0] * pad,
        ],
        torch.int64,
        device,
    )
    return DecodeInputs(n, staged[:2], staged[0], staged[1], staged[2], staged[3], staged[4, :n])
