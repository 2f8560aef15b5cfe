"""engine/decode_inputs.py: a decode step's vectors in one staging, padded for its graph."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from minfer.engine.decode_inputs import stage_decode_inputs
from minfer.kvcache.page_table import PageTable


def test_columns_hold_each_request_and_the_padding_rows_what_a_graph_needs():
    reqs = [
        SimpleNamespace(table_idx=t, cached_len=c, device_len=c + 1) for t, c in [(5, 10), (2, 0), (7, 33)]
    ]
    table = PageTable(max_rows=9, max_len=50, device=torch.device("cpu"))  # padding row: 9
    step = stage_decode_inputs(reqs, [100, 101, 102], 4, table, scratch_slot=0, device=torch.device("cpu"))
    assert step.n == 3
    assert step.table_idx.tolist() == [5, 2, 7, 9]  # the padding row: the graph's 4th row reads it
    assert step.seq_lens.tolist() == [11, 1, 34, 1]  # length after the step; padding sees one key
    assert step.positions.tolist() == [10, 0, 33, 0]
    assert step.out_loc.tolist() == [100, 101, 102, 0]  # padding K/V goes to the scratch slot
    assert step.sampled_at.tolist() == [11, 1, 34]  # only the real requests sample
    # flat token-table indices: row * max_len + position, for the input and the sampled token
    assert step.input_at.tolist() == [5 * 50 + 10, 2 * 50, 7 * 50 + 33, 9 * 50]
    assert step.sampled_to.tolist() == [5 * 50 + 11, 2 * 50 + 1, 7 * 50 + 34]
    assert step.meta.tolist() == [step.table_idx.tolist(), step.seq_lens.tolist()]
    assert step.table_idx.dtype == step.meta.dtype == torch.int64


def test_unpadded_steps_have_no_padding_columns():
    reqs = [SimpleNamespace(table_idx=0, cached_len=4, device_len=5)]
    table = PageTable(max_rows=9, max_len=50, device=torch.device("cpu"))
    step = stage_decode_inputs(reqs, [3], 1, table, scratch_slot=0, device=torch.device("cpu"))
    assert step.meta.shape == (2, 1) and step.sampled_at.tolist() == [5]
