"""The start of a decode step in one launch, from its staged vectors (engine/decode_inputs.py).

Before the model runs, a decode step must (1) record each request's new KV slot in the device
page table, (2) read its input token out of the token table, and, in a CUDA graph, (3) narrow
the staged page-table rows and sequence lengths into the graph's int32 attention metadata. As
torch ops that is five launches (a narrowing and an index_copy_, an index_select and a widening,
a copy), each a graph node of ~2 us at batch 1 for a few bytes; here it is one. Every column is
one request (or a padding column: it writes the scratch slot into the padding row, which holds
it already, and reads that row's token).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128


@triton.jit
def _decode_step_inputs_kernel(
    staged_ptr,
    stride_staged,
    slots_ptr,
    tokens_ptr,
    input_ids_ptr,
    meta_ptr,
    stride_meta,
    width,
    ROW_TABLE_IDX: tl.constexpr,
    ROW_SEQ_LENS: tl.constexpr,
    ROW_OUT_LOC: tl.constexpr,
    ROW_INPUT_AT: tl.constexpr,
    WRITE_SLOTS: tl.constexpr,
    WRITE_META: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    flat = tl.load(staged_ptr + ROW_INPUT_AT * stride_staged + offs, mask=mask, other=0)
    if WRITE_SLOTS:
        slot = tl.load(staged_ptr + ROW_OUT_LOC * stride_staged + offs, mask=mask, other=0)
        tl.store(slots_ptr + flat, slot.to(tl.int32), mask=mask)
    if WRITE_META:
        table_idx = tl.load(staged_ptr + ROW_TABLE_IDX * stride_staged + offs, mask=mask, other=0)
        seq_len = tl.load(staged_ptr + ROW_SEQ_LENS * stride_staged + offs, mask=mask, other=0)
        tl.store(meta_ptr + offs, table_idx.to(tl.int32), mask=mask)
        tl.store(meta_ptr + stride_meta + offs, seq_len.to(tl.int32), mask=mask)
    token = tl.load(tokens_ptr + flat, mask=mask, other=0)
    tl.store(input_ids_ptr + offs, token.to(tl.int64), mask=mask)


def decode_step_inputs(
    staged: torch.Tensor,
    rows: tuple[int, int, int, int],
    slots: torch.Tensor | None,
    tokens: torch.Tensor,
    meta: torch.Tensor | None = None,
) -> torch.Tensor:
    """The input token ids [width] int64 of a decode step staged as `staged` ([R, width] int64,
    whose rows `rows` are the page-table rows, sequence lengths, slots and flat table indices);
    its slots written into `slots` (the int32 page table) unless None, and its page-table rows and
    lengths narrowed into `meta` ([2, >= width] int32) when given. `tokens` is the int32 token
    table; both tables are contiguous and addressed by the flat indices."""
    width = staged.shape[1]
    input_ids = torch.empty(width, dtype=torch.int64, device=staged.device)
    if width == 0:
        return input_ids
    if staged.stride(1) != 1 or meta is not None and meta.stride(1) != 1:
        raise ValueError("the staged rows and the metadata must have contiguous columns")
    if not tokens.is_contiguous() or slots is not None and not slots.is_contiguous():
        raise ValueError("the page and token tables must be contiguous")
    _decode_step_inputs_kernel[(triton.cdiv(width, BLOCK),)](
        staged,
        staged.stride(0),
        slots if slots is not None else tokens,
        tokens,
        input_ids,
        meta if meta is not None else input_ids,
        meta.stride(0) if meta is not None else 0,
        width,
        ROW_TABLE_IDX=rows[0],
        ROW_SEQ_LENS=rows[1],
        ROW_OUT_LOC=rows[2],
        ROW_INPUT_AT=rows[3],
        WRITE_SLOTS=slots is not None,
        WRITE_META=meta is not None,
        BLOCK=BLOCK,
        num_warps=1,
    )
    return input_ids
