"""Fused sampling: temperature + Gumbel-max over the whole vocabulary in one read of the logits.

The torch sampler (minfer/engine/sampler.py) builds the [B, V] noise with a dozen integer
kernels, each a full pass over B x V values (3.3 ms of a 13 ms decode step at B=256 on an
H200, measured). This kernel computes the same hash, noise and argmax while reading each
logit once. It draws exactly the torch sampler's noise, so both paths pick the same tokens
(up to float rounding in log()). Rows with temperature 0 take the plain argmax.
Top-k / top-p / min-p rows are left to the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minfer.core import NO_TOKEN as _NO_TOKEN
from minfer.kernels.common import INTERPRET, num_sms
from minfer.kernels.pdl import pdl_args, pdl_start

# The noise is -log(-log(u)); libdevice's logf (a range reduction and a polynomial of ~20
# instructions) twice per logit bounded the kernel at large batches. The outer logarithm is MUFU
# lg2.approx: its error, at most 2**-22 absolute on [0.5, 2] and 2 ulp elsewhere, moves the noise
# by < 1e-6, under the float32 rounding of the logits it perturbs. The inner one cannot be MUFU
# alone: u reaches 1 - 2**-23, where log(u) = -1.2e-7 and an absolute error of 2**-22 would make
# -log(u) zero or negative, the noise +inf or NaN (the draws that would differ are those of the
# largest noise, the likeliest winners). So near 1 (SERIES_LOG) it is the series
# -log(1 - w) = w + w^2/2 + ... + w^6/6 of w = 1 - u (an exact subtraction), and MUFU only
# below u = 15/16, where |log2 u| >= 0.093 keeps MUFU's relative error under 3e-6. H100, 256
# rows: 114.1 us with libdevice's logs, 87.1 with the outer one MUFU, 70.5 with both; no draw of
# 5,120 different (docs/BENCHMARKS.md, thirty-seventh session). The CPU interpreter cannot run
# PTX and takes tl.log where MUFU would be (the series still runs there, so CPU tests check it).
# Module attributes, so that an A/B script can switch them (scripts/gpu_sampler_ab.py).
FAST_LOG = not INTERPRET.value
SERIES_LOG = True
_LN2 = tl.constexpr(0.6931471805599453)
NO_TOKEN = tl.constexpr(_NO_TOKEN)


@triton.jit
def _mix32(x):
    """A 32-bit integer mix (the sampler's `mix32`), in uint32 arithmetic: products wrap
    modulo 2**32 by themselves, as the torch version's `& 0xFFFFFFFF` makes them. (Written
    with int64 and masks, as it first was, each multiply became a multi-instruction 64-bit
    one, and the hash, not memory, bounded the kernel.)"""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _ln(x, FAST: tl.constexpr):
    """log(x) for x > 0 (see FAST_LOG)."""
    if FAST:
        log2 = tl.inline_asm_elementwise(
            "lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
        return log2 * _LN2
    return tl.log(x)


@triton.jit
def _neg_log_uniform(bits, FAST: tl.constexpr, SERIES: tl.constexpr):
    """-log(u) of the uniform u = ((bits >> 9) + 0.5) / 2**23 (sampler.UNIFORM_BITS: 23), in
    (0, 16.6]: finite and positive for every hash (see FAST_LOG)."""
    u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    if SERIES:
        # exact: 1 - u = (2**23 - k - 0.5) / 2**23 has 24 significant bits, as u has
        w = 1.0 - u
        # up to w^6/6: the next term is under 1e-8 of the sum for w < 1/16
        series = w * (1.0 + w * (0.5 + w * (1.0 / 3.0 + w * (0.25 + w * (0.2 + w * (1.0 / 6.0))))))
        return tl.where(w < 0.0625, series, -_ln(u, FAST))
    return -tl.log(u)


# Each program scans CHUNK vocabulary entries of one row, BLOCK at a time. One program per
# row (the first version) left most of an H200 idle: 256 rows x 151,936 entries took 183 us
# against 36 us of memory traffic. With chunks a batch of 256 is ~9,700 programs and a batch of
# one still spreads over 38 SMs: 100 us at B=256 (with the uint32 hash and per-lane bests),
# where the two logs per logit are now the bound. A batch too small to give every SM one
# program takes chunks of one block instead (SMALL_CHUNK): at batch 1 that is 149 programs of
# one step each for Qwen3's vocabulary, not 38 programs of four steps, which the step waits for
# one after another. (The first rule, under two programs per SM, also took batches of 4-6; the
# offline bench's 4-7 band was then 0.05-0.08 ms slower in one call of two, unexplained, so
# those batches keep the large chunks: docs/BENCHMARKS.md, twentieth session.)
# Both passes take programmatic dependent launch where the rows are chained (pdl.pdl_args):
# at one or two rows pass 1 then starts while the LM head's gemv finishes, and pass 2 while pass
# 1 does, instead of after each (docs/BENCHMARKS.md, thirty-eighth session).
CHUNK = 4096
SMALL_CHUNK = 1024
BLOCK = 1024


def chunk_for(batch: int, vocab: int, device: torch.device) -> int:
    """Vocabulary entries per program: SMALL_CHUNK while CHUNK would leave SMs without one."""
    return SMALL_CHUNK if batch * triton.cdiv(vocab, CHUNK) < num_sms(device) else CHUNK


@triton.jit
def _gumbel_argmax_chunk_kernel(
    logits_ptr,
    stride_row,
    temperature_ptr,
    seeds_ptr,
    positions_ptr,
    best_val_ptr,
    best_idx_ptr,
    vocab_size,
    col_offset,
    num_chunks,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    FAST: tl.constexpr,
    SERIES: tl.constexpr,
    PDL_RELEASE: tl.constexpr,
    PDL_WAIT: tl.constexpr,
):
    """Pass 1, grid (row, chunk): the best perturbed logit of one chunk of one row. Column c
    of `logits` is vocabulary entry col_offset + c (a TP rank's shard starts there), and its
    noise is that entry's."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    # The row's parameters are staged by the host (pdl.pdl_start: readable before the wait);
    # the logits are the LM head's, after it.
    temperature = tl.load(temperature_ptr + row)
    seed = tl.load(seeds_ptr + row).to(tl.int64)
    position = tl.load(positions_ptr + row).to(tl.int64)
    row_key = _mix32(((seed * 0x9E3779B1 + position * 0x85EBCA77 + 0x165667B1) & 0xFFFFFFFF).to(tl.uint32))
    inv_t = 1.0 / tl.where(temperature > 0, temperature, 1.0)
    pdl_start(PDL_RELEASE, PDL_WAIT)
    # Each lane keeps its own best over the chunk (first index on ties), and the lanes are
    # reduced once at the end: a block-wide max and argmax per step cost more than the hash.
    lane_val = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    lane_idx = tl.zeros([BLOCK], dtype=tl.int32)
    for offset in range(0, CHUNK, BLOCK):
        cols = chunk * CHUNK + offset + tl.arange(0, BLOCK)
        mask = cols < vocab_size
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=mask, other=float("-inf"))
        if temperature > 0:
            vocab_cols = (cols + col_offset).to(tl.uint32)
            bits = _mix32((row_key ^ (vocab_cols * 0x27D4EB2F)) + 0x61C88647)
            x = x * inv_t - _ln(_neg_log_uniform(bits, FAST, SERIES), FAST)
            x = tl.where(mask, x, float("-inf"))
        # A NaN is taken and then kept (nothing compares greater than it), as torch's max
        # takes it: a row with any NaN has nothing to draw (core.NO_TOKEN, set in pass 2).
        # One comparison per logit: 70.5 -> 73.5 us at 256 rows on an H100 (BENCHMARKS.md).
        better = (x > lane_val) | (x != x)
        lane_val = tl.where(better, x, lane_val)
        lane_idx = tl.where(better, cols, lane_idx)
    best_val = tl.max(lane_val, 0)
    # the lowest index holding the best value, as torch.argmax picks (a chunk of only -inf,
    # or a best that is NaN, keeps its first column: a real id for the token table)
    best_idx = tl.min(tl.where(lane_val == best_val, lane_idx, 2147483647), 0)
    best_idx = tl.where(best_val > float("-inf"), best_idx, chunk * CHUNK)
    # tl.max may pass over a NaN; +inf stands for it, which pass 2 finds not finite
    best_val = tl.where(tl.max((lane_val != lane_val).to(tl.int32), 0) > 0, float("inf"), best_val)
    tl.store(best_val_ptr + row * num_chunks + chunk, best_val)
    tl.store(best_idx_ptr + row * num_chunks + chunk, best_idx)


@triton.jit
def _pick_best_chunk_kernel(
    best_val_ptr,
    best_idx_ptr,
    out_ptr,
    out_val_ptr,
    table_ptr,
    table_at_ptr,
    num_chunks,
    BLOCK_C: tl.constexpr,
    WRITE_TABLE: tl.constexpr,
    PDL_RELEASE: tl.constexpr,
    PDL_WAIT: tl.constexpr,
):
    """Pass 2, grid (row,): the token of the best chunk (the first of equal ones) and its value,
    or NO_TOKEN where that value is not finite (all -inf, or +inf, which pass 1 also gives a
    chunk holding a NaN); with WRITE_TABLE also the token (int32) at flat index table_at[row]
    of the token table, there always a real id (core.NO_TOKEN says why)."""
    pdl_start(PDL_RELEASE, PDL_WAIT)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    vals = tl.load(best_val_ptr + row * num_chunks + offs, mask=offs < num_chunks, other=float("-inf"))
    best = tl.argmax(vals, 0)
    token = tl.load(best_idx_ptr + row * num_chunks + best)
    best_val = tl.max(vals, 0)
    drawable = (best_val > float("-inf")) & (best_val < float("inf"))
    tl.store(out_ptr + row, tl.where(drawable, token, NO_TOKEN).to(tl.int64))
    tl.store(out_val_ptr + row, best_val)
    if WRITE_TABLE:
        tl.store(table_ptr + tl.load(table_at_ptr + row), token.to(tl.int32))


def gumbel_argmax(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    chunk: int | None = None,
    out: torch.Tensor | None = None,
    table: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """logits [B, V] float32 (last dim contiguous) -> sampled token ids [B] int64 (NO_TOKEN for
    a row without a finite logit), into `out` when given. `table`: (the flattened int32 token table, [B] int64 flat indices) where each
    row's token is also written, in the same launch (a decode graph's draw: engine/cuda_graph.py)."""
    return gumbel_best(logits, temperature, seeds, positions, chunk=chunk, out=out, table=table)[0]


def gumbel_best(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    col_offset: int = 0,
    chunk: int | None = None,
    out: torch.Tensor | None = None,
    table: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(column [B] int64, perturbed value [B] float32) of each row's winner; the columns of
    `logits` are vocabulary entries col_offset.. (see the chunk kernel). `chunk`: entries per
    program (a multiple of BLOCK), else `chunk_for`'s. `out`, `table`: as in gumbel_argmax."""
    batch, vocab = logits.shape
    if out is None:
        out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    table_values, table_at = table if table is not None else (out, out)  # unread without a table
    out_val = torch.empty(batch, dtype=torch.float32, device=logits.device)
    if batch:
        chunk = chunk or chunk_for(batch, vocab, logits.device)
        num_chunks = triton.cdiv(vocab, chunk)
        best_val = torch.empty((batch, num_chunks), dtype=torch.float32, device=logits.device)
        best_idx = torch.empty((batch, num_chunks), dtype=torch.int32, device=logits.device)
        _gumbel_argmax_chunk_kernel[(batch, num_chunks)](
            logits,
            logits.stride(0),
            temperature,
            seeds,
            positions,
            best_val,
            best_idx,
            vocab,
            col_offset,
            num_chunks,
            CHUNK=chunk,
            BLOCK=BLOCK,
            FAST=FAST_LOG,
            SERIES=SERIES_LOG,
            num_warps=4,
            **pdl_args(logits.device, batch),
        )
        _pick_best_chunk_kernel[(batch,)](
            best_val,
            best_idx,
            out,
            out_val,
            table_values,
            table_at,
            num_chunks,
            BLOCK_C=triton.next_power_of_2(num_chunks),
            WRITE_TABLE=table is not None,
            num_warps=1,
            **pdl_args(logits.device, batch),
        )
    return out, out_val
