"""Page table and token table: per-request rows mapping position -> slot and position -> token id."""

from __future__ import annotations

import torch

from minfer.device import to_device

# Up to this many positions, per-position work is cheaper in Python lists than in tensor ops
# (measured on the 2-core development CPU: docs/BENCHMARKS.md, "Host work of a decode step").
FEW_POSITIONS = 64


def runs_of_positions(
    rows: list[int], starts: list[int], lengths: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, position) of every position in consecutive runs, as two int64 CPU tensors: run
    i covers positions starts[i] .. starts[i] + lengths[i] - 1 of row rows[i].

    Built with tensor ops because a prefill pass covers thousands of positions: as Python lists
    (and then a tensor made from them) the three per-token vectors of one 8192-token pass cost
    ~1.5 ms of CPU, which the GPU waits for whenever a pass's launches are its bound. A few
    positions (a decode step) are the other way round: six tensor ops cost ~25 us, the lists
    ~3 us."""
    total = int(sum(lengths))
    if total <= FEW_POSITIONS:
        row = [r for r, n in zip(rows, lengths) for _ in range(n)]
        position = [p for s, n in zip(starts, lengths) for p in range(s, s + n)]
        return torch.tensor(row, dtype=torch.int64), torch.tensor(position, dtype=torch.int64)
    counts = torch.tensor(lengths, dtype=torch.int64)
    row = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), counts, output_size=total)
    # a position is its run's start plus its offset in the run: global index - the run's first index
    first_index = torch.cumsum(counts, 0) - counts
    shift = torch.tensor(starts, dtype=torch.int64) - first_index
    return row, torch.arange(total, dtype=torch.int64) + torch.repeat_interleave(
        shift, counts, output_size=total
    )


class PageTable:
    """`slots[row, position]` is the pool slot holding that position's K/V;
    `tokens[row, position]` is the token id at that position (prompt and sampled tokens).

    Both live on the compute device, where the attention kernels and the input gather read
    them; the slot table has a CPU mirror so the scheduler can look slots up without a sync.
    """

    def __init__(self, max_rows: int, max_len: int, device: torch.device):
        self.max_rows = max_rows
        self.max_len = max_len
        self.device = device
        # One extra row, never handed out: padded rows of a CUDA-graph batch read it.
        self.padding_row = max_rows
        self.slots = torch.zeros((max_rows + 1, max_len), dtype=torch.int32, device=device)
        self.tokens = torch.zeros((max_rows + 1, max_len), dtype=torch.int32, device=device)
        # On a CPU device the mirror is the table itself.
        self.slots_cpu = (
            self.slots if device.type == "cpu" else torch.zeros((max_rows + 1, max_len), dtype=torch.int32)
        )
        self._free_rows = list(range(max_rows - 1, -1, -1))

    @property
    def mirrored(self) -> bool:
        """Whether the host mirror is a tensor apart from the device table (on a GPU): then a
        write must reach both."""
        return self.slots is not self.slots_cpu

    def point_padding_row_at(self, slot: int) -> None:
        self.slots[self.padding_row].fill_(slot)
        self.slots_cpu[self.padding_row].fill_(slot)  # the same tensor on CPU: harmless

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    @property
    def free_row_ids(self) -> list[int]:
        return self._free_rows

    def take_row(self) -> int:
        return self._free_rows.pop()

    def give_back_row(self, row: int) -> None:
        self._free_rows.append(row)

    def write_tokens(self, row: int, start: int, token_ids: list[int]) -> None:
        self.tokens[row, start : start + len(token_ids)] = to_device(token_ids, torch.int32, self.device)

    # Tables are addressed through flat indices (row * max_len + position) with index_select /
    # index_copy_: on CPU, advanced indexing runs a parallel kernel whose thread wake-up costs
    # milliseconds on a busy machine; on CUDA both are single kernels.
    def write_slots(self, rows, positions, slots, write_device: bool = True) -> None:
        """Record slots for (row, position) pairs, given as three sequences (lists or CPU
        tensors) of one length; in the host mirror alone without `write_device` (the caller
        then writes the device table with `write_slots_at`)."""
        if len(slots) <= FEW_POSITIONS:  # a decode step: one tensor from lists (see runs_of_positions)
            rows, positions = _as_list(rows), _as_list(positions)
            flat = [r * self.max_len + p for r, p in zip(rows, positions)]
            packed = torch.tensor([flat, _as_list(slots)], dtype=torch.int64)
        else:
            flat = torch.as_tensor(rows, dtype=torch.int64) * self.max_len + torch.as_tensor(
                positions, dtype=torch.int64
            )
            packed = torch.stack([flat, torch.as_tensor(slots, dtype=torch.int64)])
        self.slots_cpu.view(-1).index_copy_(0, packed[0], packed[1].to(torch.int32))
        if not self.mirrored or not write_device:
            return
        dev = to_device(packed, torch.int64, self.device)
        self.write_slots_at(dev[0], dev[1])

    def write_slots_at(self, flat: torch.Tensor, slots: torch.Tensor) -> None:
        """The device table's entries at flat indices (`flat_index`) set to slots (device
        tensors of one length)."""
        self.slots.view(-1).index_copy_(0, flat, slots.to(torch.int32))

    def gather_tokens(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token ids at (row, position) pairs (device int64 tensors), as int64."""
        return self.tokens.view(-1).index_select(0, rows * self.max_len + positions).long()

    def flat_index(self, row: int, position: int) -> int:
        """The index of (row, position) in a flattened table (`tokens_at`, `scatter_tokens_at`,
        `write_slots_at`: both tables have one shape)."""
        return row * self.max_len + position

    def tokens_at(self, flat: torch.Tensor) -> torch.Tensor:
        """Token ids at flat indices (a device int64 tensor), as stored (int32)."""
        return self.tokens.view(-1).index_select(0, flat)

    def scatter_tokens_at(self, flat: torch.Tensor, token_ids: torch.Tensor) -> None:
        self.tokens.view(-1).index_copy_(0, flat, token_ids.to(torch.int32))

    def row_slots(self, row: int, length: int) -> torch.Tensor:
        return self.slots_cpu[row, :length]


def _as_list(values) -> list[int]:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)
