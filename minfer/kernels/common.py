"""Helpers shared by the Triton kernels."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# Triton's CPU interpreter (TRITON_INTERPRET=1, used by the tests without a GPU) keeps bf16 as
# raw uint16 bits and its tl.dot multiplies those bits as integers (seen in triton 3.9), so
# under the interpreter dot operands are widened to fp32 first. Read once, at import: the
# interpreter itself is chosen when the kernels are defined.
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


CACHE_LINE = 128  # bytes: the granule of prefetch_l2


@functools.cache
def arrival_counters(device: torch.device, user: str, count: int) -> torch.Tensor:
    """A zeroed int32 buffer of `count` arrival counters on `device`, one buffer per `user` (a
    kernel kind). A kernel whose last program to arrive finishes the work (the split-K GEMM's
    sum, the router's selection) counts arrivals here, and that program puts its counter back
    to zero, so the buffer is zero between launches and a CUDA graph can replay them. Launches
    on one stream run one after another, so two never count in one buffer at once. The first
    call must come before any graph capture (the warm-up does it), or the zeroing would be
    captured."""
    return torch.zeros(count, dtype=torch.int32, device=device)


@triton.jit
def prefetch_l2(ptrs, mask):
    """Ask for the cache lines at `ptrs` (where `mask`) to be brought into L2, without waiting
    for them or holding registers: a kernel launched early (pdl_start) does this before its wait
    for data that no earlier kernel of the step writes, so its first loads after the wait come
    from L2 rather than DRAM. A hint only; compiled out under the interpreter."""
    if not INTERPRET:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,r",
            [ptrs, mask.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


def matmul_operands(
    x: torch.Tensor, weight: torch.Tensor, features: int | None = None, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """For y = x [..., K] @ weight [N, K].T: x as [M, K] rows with a contiguous last dim (rows may
    stay strided) and the output [M, N]: `out` once checked (contiguous, x's dtype or float32),
    else a new one in x's dtype. `features`: x's row width when it is not K (gemv's SiLU
    prologue reads rows of [gate | up], 2K wide)."""
    n, k = weight.shape
    features = features or k
    if x.shape[-1] != features:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {features}")
    assert weight.stride(-1) == 1
    x2 = x.reshape(-1, features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    shape = (x2.shape[0], n)
    if out is None:
        return x2, torch.empty(shape, dtype=x.dtype, device=x.device)
    if out.shape != shape or not out.is_contiguous() or out.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"out must be contiguous {shape} in {x.dtype} or float32")
    return x2, out


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, which launch heuristics size grids by; off
    CUDA (the interpreter) a small stand-in, so the tests exercise split launches."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device.index or 0).multi_processor_count


@triton.jit
def dot(a, b):
    """a @ b accumulated in fp32. fp32 operands get a true fp32 product (the default would be
    tf32 on tensor cores) so the fp32 path matches the torch reference to fp32 rounding."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


# The largest finite float8_e4m3fn (the format has no infinity). A constexpr: compiled (not
# interpreted) kernels may read a module global only in that form.
FP8_MAX = tl.constexpr(448.0)


def gather_rows(pool: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype):
    """Pool rows at `slots` ([S, Hk, D]) as float32, for the torch references: an fp8 pool
    times its per-head scales and rounded to the compute dtype (what KVPool.gather_heads returns),
    any other pool as stored. fp8 rows are indexed as bytes: not every torch build indexes
    float8 tensors on every device."""
    if scale is None:
        return pool[slots].float()
    rows = pool.view(torch.uint8)[slots].view(pool.dtype)
    return (rows.float() * scale[:, None]).to(dtype).float()


@triton.jit
def to_fp8(x, scale):
    """x / scale as float8_e4m3fn, saturated at +-448 and rounded to nearest even, as torch's
    `(x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)` rounds (KVPool.store).

    Triton 3.9's interpreter rounds fp32 -> fp8 wrongly (a mantissa carry into the exponent is
    dropped: 1.98 becomes 1.0, seen on ~2.5% of random values, and subnormals are flushed), so
    under the interpreter the value is first rounded to the e4m3 grid in fp32, which it then
    casts exactly. On the GPU the hardware conversion is used."""
    y = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -FP8_MAX), FP8_MAX)
    if INTERPRET:
        # normal range: keep 3 of fp32's 23 mantissa bits, ties to even
        bits = y.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        # subnormals (|y| < 2^-6) are multiples of 2^-9: the ulp of fp32 values in [2^14, 2^15)
        tiny = (tl.abs(y) + 24576.0) - 24576.0
        y = tl.where(tl.abs(y) < 0.015625, tl.where(y < 0, -tiny, tiny), normal)
    return y.to(tl.float8e4nv)


@triton.jit
def fp8_pool_operand(q):
    """q in the dtype the products with an fp8 pool run in: fp16 for a bf16 model (the hardware
    widens e4m3 to fp16 directly, while reaching bf16 takes more conversion work per element,
    and fp16 keeps more of q's mantissa); a float32 model keeps float32."""
    # one return after a compile-time branch: the form that was compiled and measured on the H200
    if q.dtype == tl.bfloat16:
        q = q.to(tl.float16)
    return q


@functools.cache
def ptx_widens_e4m3(device: torch.device) -> bool:
    """Whether widen_e4m3_rows can run on `device`: compiled kernels (not the interpreter) on
    compute capability 8.9 or later, where PTX has the e4m3 -> fp16 conversion."""
    return not INTERPRET and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@triton.jit
def widen_e4m3_rows(x):
    """An e4m3 tensor as fp16 (exact), converted in the layout it was loaded in.

    Why not `x.to(tl.float16)`: when x feeds tl.dot as its right operand, Triton moves the
    conversion past the layout change into the tensor-core operand layout (fewer bytes through
    shared memory), and for V in decode attention that layout change is the costly part: an
    operand register wants two keys of one column while V's bytes lie along the head dim, and
    sm_90 has no transposing 8-bit ldmatrix, so the bytes were gathered one by one (230 LDS and
    ~420 IMAD of a 1,768-instruction launch, scripts/kernel_registers.py). Triton does not move
    inline assembly that is marked impure, so the widening stays here and the fp16 tile takes
    the bf16 kernel's path (one store, transposing 16-bit ldmatrix): 1,336 instructions."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r",
        [x.to(tl.uint8, bitcast=True)],
        dtype=tl.float16,
        is_pure=False,
        pack=4,
    )


@triton.jit
def attend_blocks(
    q,
    q_pos,
    m_i,
    l_i,
    acc,
    page_row,
    k_head,
    v_head,
    stride_ks,
    stride_vs,
    start,
    end,
    sm_scale_log2,
    offs_n,
    offs_d,
    d_mask,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr,
    V_PTX_WIDEN: tl.constexpr = False,
):
    """Online-softmax steps of q's rows over keys [start, end), gathered slot by slot through
    a page-table row; returns the updated (running max, running sum, accumulator), base 2.

    MASKED: bound-check keys against `end` (without it every step must be a whole block).
    CAUSAL (with MASKED): the row at position q_pos[i] sees keys at positions <= q_pos[i].
    WINDOW > 0 (with CAUSAL): and only keys at positions > q_pos[i] - WINDOW; a row may then
    see no key of a block yet, so its running maximum may still be -inf.
    V_PTX_WIDEN: an fp8 pool's V widened where it is loaded (widen_e4m3_rows); see there.
    Used by the decode kernel (masked, not causal) and the extend kernel (both ways)."""
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        if MASKED:
            n_mask = pos < end
            slots = tl.load(page_row + pos, mask=n_mask, other=0).to(tl.int64)
            kv_mask = n_mask[:, None] & d_mask[None, :]
        else:
            slots = tl.load(page_row + pos).to(tl.int64)
            kv_mask = d_mask[None, :]
        # An fp8 cache is widened to q's dtype here (exact); its scales are applied by the caller
        # to the scores and the output, once per program rather than once per element.
        k = tl.load(k_head + slots[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0).to(
            q.dtype
        )
        scores = dot(q, tl.trans(k)) * sm_scale_log2
        if MASKED:
            visible = n_mask[None, :]
            if CAUSAL:
                visible = visible & (pos[None, :] <= q_pos[:, None])
            if WINDOW > 0:
                visible = visible & (pos[None, :] > q_pos[:, None] - WINDOW)
            scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_base = m_new
        if WINDOW > 0:  # a row with no key yet: exp2(-inf - 0) = 0 rather than exp2(nan)
            m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_base)
        p = tl.exp2(scores - m_base[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + slots[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        if V_PTX_WIDEN:
            v = widen_e4m3_rows(v)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v)
        m_i = m_new
    return m_i, l_i, acc
