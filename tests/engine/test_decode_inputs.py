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
    assert step.staged[-1, 3] == 9 * 50  # a graph's padding row writes its drawn token in its own row
    assert step.meta.tolist() == [step.table_idx.tolist(), step.seq_lens.tolist()]
    assert step.table_idx.dtype == step.meta.dtype == torch.int64


def test_a_graph_buffer_is_staged_in_place_and_keeps_its_padding_beyond_the_width():
    """Staged `into` a graph's buffer: the step's columns are views of it, and columns past the
    width keep the padding the buffer was made with (a smaller step never leaves a larger one's
    slots there for a graph to write into)."""
    from minfer.engine.decode_inputs import padding_columns

    table = PageTable(max_rows=9, max_len=50, device=torch.device("cpu"))
    buffer = torch.tensor(padding_columns(8, table, scratch_slot=77), dtype=torch.int64)
    reqs = [SimpleNamespace(table_idx=3, cached_len=6, device_len=7)]
    step = stage_decode_inputs(reqs, [40], 2, table, scratch_slot=77, device=torch.device("cpu"), into=buffer)
    assert step.staged.data_ptr() == buffer.data_ptr() and step.staged.shape == (7, 2)
    assert buffer[:, 0].tolist() == [3, 7, 6, 40, 3 * 50 + 6, 7, 3 * 50 + 7]
    assert buffer[:, 1].tolist() == buffer[:, 7].tolist() == [9, 1, 0, 77, 9 * 50, 0, 9 * 50]


def test_a_decode_step_writes_its_slots_where_allocation_left_the_device_table_alone():
    """KVManager.allocate(write_device=False) records the slots in the host mirror; the step's
    DecodeInputs.start puts them in the device table (here a second CPU table stands in
    for the device one, as on CUDA the two are distinct tensors)."""
    table = PageTable(max_rows=9, max_len=50, device=torch.device("cpu"))
    table.slots_cpu = table.slots.clone()  # as on CUDA: a mirror apart from the device table
    table.point_padding_row_at(77)
    table.write_slots([3], [6], [40], write_device=False)
    assert table.slots_cpu[3, 6] == 40 and table.slots[3, 6] == 0
    reqs = [SimpleNamespace(table_idx=3, cached_len=6, device_len=7)]
    step = stage_decode_inputs(reqs, [40], 2, table, scratch_slot=77, device=torch.device("cpu"))
    table.tokens[3, 6] = 1234
    assert step.start(table).tolist() == [1234, 0]
    assert table.slots[3, 6] == 40 and torch.equal(table.slots[9], torch.full((50,), 77, dtype=torch.int32))


def test_unpadded_steps_have_no_padding_columns():
    reqs = [SimpleNamespace(table_idx=0, cached_len=4, device_len=5)]
    table = PageTable(max_rows=9, max_len=50, device=torch.device("cpu"))
    step = stage_decode_inputs(reqs, [3], 1, table, scratch_slot=0, device=torch.device("cpu"))
    assert step.meta.shape == (2, 1) and step.sampled_at.tolist() == [5]
