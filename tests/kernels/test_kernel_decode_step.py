"""minfer.kernels.decode_step: a decode step's first launch against the torch ops it replaces."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from minfer.engine.decode_inputs import INPUT_AT, OUT_LOC, SEQ_LENS, TABLE_IDX, stage_decode_inputs
from minfer.kernels.decode_step import decode_step_inputs
from minfer.kvcache.page_table import PageTable

ROWS = (TABLE_IDX, SEQ_LENS, OUT_LOC, INPUT_AT)


@pytest.mark.parametrize("n, width", [(3, 4), (1, 1), (130, 144)])
def test_the_kernel_writes_the_slots_reads_the_tokens_and_narrows_the_metadata(n, width, device):
    """Three requests padded to a graph of 4, one unpadded, and more columns than one program
    holds: the page table afterwards, the input ids and the int32 metadata are what index_copy_,
    index_select and a copy make of the same staged rows; the padding row keeps the scratch slot."""
    gen = torch.Generator().manual_seed(n)
    table = PageTable(max_rows=200, max_len=64, device=torch.device("cpu"))
    table.point_padding_row_at(999)
    table.tokens.copy_(torch.randint(0, 50_000, table.tokens.shape, generator=gen, dtype=torch.int32))
    table.slots.copy_(torch.randint(0, 5_000, table.slots.shape, generator=gen, dtype=torch.int32))
    table.point_padding_row_at(999)
    rows = torch.randperm(200, generator=gen)[:n].tolist()
    lens = torch.randint(0, 60, (n,), generator=gen).tolist()
    reqs = [SimpleNamespace(table_idx=r, cached_len=c, device_len=c + 1) for r, c in zip(rows, lens)]
    out_loc = torch.randint(0, 5_000, (n,), generator=gen).tolist()
    step = stage_decode_inputs(reqs, out_loc, width, table, scratch_slot=999, device=torch.device("cpu"))

    expected_slots = table.slots.clone()
    expected_slots.view(-1).index_copy_(0, step.input_at, step.out_loc.to(torch.int32))
    expected_ids = table.tokens.view(-1).index_select(0, step.input_at).long()

    slots, tokens = table.slots.to(device), table.tokens.to(device)
    meta = torch.full((2, width + 5), -7, dtype=torch.int32, device=device)
    ids = decode_step_inputs(step.staged.to(device), ROWS, slots, tokens, meta)
    assert ids.dtype == torch.int64 and ids.tolist() == expected_ids.tolist()
    assert torch.equal(slots.cpu(), expected_slots)
    assert all(expected_slots[r, c] == s for r, c, s in zip(rows, lens, out_loc))
    assert torch.equal(slots[200].cpu(), torch.full((64,), 999, dtype=torch.int32))  # the padding row
    assert meta[:, :width].tolist() == step.meta.tolist() and (meta[:, width:] == -7).all()

    untouched = table.slots.to(device)  # without a table to write, only the ids (and no meta)
    again = decode_step_inputs(step.staged.to(device), ROWS, None, tokens)
    assert again.tolist() == expected_ids.tolist() and torch.equal(untouched.cpu(), table.slots)
