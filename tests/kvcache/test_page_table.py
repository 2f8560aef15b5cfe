"""The page table's bulk writes and the per-position coordinates prefill passes are built from."""

from __future__ import annotations

import random

import torch

from minfer.kvcache.page_table import PageTable, runs_of_positions


def test_runs_of_positions_match_the_positions_one_by_one():
    """Every run's positions in order, empty runs included, as the per-token lists were built."""
    rng = random.Random(0)
    for _ in range(50):
        count = rng.randint(0, 6)
        rows = [rng.randint(0, 9) for _ in range(count)]
        starts = [rng.randint(0, 50) for _ in range(count)]
        lengths = [rng.choice([0, 1, rng.randint(2, 40)]) for _ in range(count)]
        want_rows, want_positions = [], []
        for row, start, n in zip(rows, starts, lengths):
            want_rows += [row] * n
            want_positions += range(start, start + n)
        got_rows, got_positions = runs_of_positions(rows, starts, lengths)
        assert got_rows.dtype == got_positions.dtype == torch.int64
        assert got_rows.tolist() == want_rows
        assert got_positions.tolist() == want_positions


def test_write_slots_takes_lists_and_tensors_alike():
    table = PageTable(max_rows=4, max_len=16, device=torch.device("cpu"))
    table.write_slots([1, 1, 2], [0, 1, 5], [7, 8, 9])
    rows, positions = runs_of_positions([3], [2], [3])
    table.write_slots(rows, positions, torch.tensor([10, 11, 12]))
    assert table.row_slots(1, 2).tolist() == [7, 8]
    assert int(table.slots_cpu[2, 5]) == 9
    assert table.row_slots(3, 5).tolist() == [0, 0, 10, 11, 12]


def test_write_slots_is_the_same_above_and_below_the_few_positions_path():
    """Decode-sized writes go through Python lists, prefill-sized ones through tensor ops."""
    from minfer.kvcache.page_table import FEW_POSITIONS

    for n in (1, FEW_POSITIONS, FEW_POSITIONS + 1, 3 * FEW_POSITIONS):
        table = PageTable(max_rows=4, max_len=512, device=torch.device("cpu"))
        rows, positions = runs_of_positions([2, 0], [5, 0], [n // 2, n - n // 2])
        table.write_slots(rows, positions, list(range(100, 100 + n)))
        assert table.row_slots(2, 5 + n // 2)[5:].tolist() == list(range(100, 100 + n // 2))
        assert table.row_slots(0, n - n // 2).tolist() == list(range(100 + n // 2, 100 + n))
