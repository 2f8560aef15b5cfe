"""Paged extend (prefill) attention in Triton: many new tokens per request, causal over the cache.

Request b computes queries for positions [prefix_lens[b], seq_lens[b]); its tokens sit in the
flattened q at rows [cu_extend_lens[b], cu_extend_lens[b + 1]). Every key in [0, seq_lens[b])
is read through `page_table[table_idx[b], pos]`: the cached prefix and this pass's own tokens,
which the attention layer stored in the pool before the call. Query j (position prefix + j)
sees keys [0, prefix + j].

One program per (query tile, q head); a flash-attention loop with an online softmax in fp32.
Keys are walked only up to the last position the block's queries can see, and only the key
blocks that reach the block's own positions pay for the causal mask. The engine hands the
kernel a tile map (`extend_tiles`: which request and query block each program takes), built
once per pass on the CPU; its length can be fixed, which a CUDA graph needs (the map is padded
with tiles past a request's end). Without one the grid is (query block, request, q head),
sized by the longest extend, and query blocks past a request's extend return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minfer.kernels.common import attend_blocks, fp8_pool_operand

try:
    from minfer.kernels import attention_extend_wgmma
except ImportError:  # a Triton without Gluon (before 3.4): every launch stays on this kernel
    attention_extend_wgmma = None

LOG2E = 1.4426950408889634
# GPU launch configurations (BLOCK_M, BLOCK_N, num_warps, num_stages, register cap: Triton's
# maxnreg, None for none), chosen per launch by the longest extend and the pool's dtype.
#
# Short extends (prompts of a few hundred tokens packed into one chunk: the offline workload's
# prefill) waste less on padding with 64-row tiles. On an H200 (scripts/gpu_extend_short.py:
# Qwen3-0.6B heads, 8192 tokens of 13 packed prompts / Llama-8B heads, 4 x (1024 + 1024 new)):
#  - bf16: 64 x 32 tiles with a 128-register cap, 123 / 321 us, against 138 / 346 for the 64 x 64
#    tiles used before; the cap lets four programs share an SM (uncapped 64 x 32: three, 134 /
#    353 us; 64 x 64: two). 18 configurations x caps timed.
#  - fp8: 64 x 64 tiles capped at 168 registers, 134 / 367 us (uncapped: 176 registers, two
#    programs per SM, 151 / 423 us); 64 x 32 tiles were slower over fp8 at every cap.
# A long prompt's chunks are compute-bound, where 128 x 128 tiles with 8 warps and 3 stages
# feed the tensor cores best: one 32k-token prompt in 8k chunks at 426 TFLOP/s against 350 for
# 64 x 64 tiles, best of 12 (scripts/gpu_check.py --extend-long, which also times where the
# long one starts to lead: 1536-token prompts, measured against the 64 x 64 tiles). Its shared
# memory limits it to one program per SM, so no register cap could buy it a second.
# The CPU interpreter uses 16 x 16 blocks: it pays for every padded element.
SHORT_CONFIGS: dict[str, tuple[int, int, int, int, int | None]] = {
    "bf16": (64, 32, 4, 2, 128),
    "fp8": (64, 64, 4, 2, 168),
}
LONG_CONFIG: tuple[int, int, int, int, int | None] = (128, 128, 8, 3, None)
LONG_EXTEND = 1536  # tokens: a launch whose longest extend reaches this takes LONG_CONFIG
# Query blocks run last-first: under the causal mask a later block sees more keys, so starting
# with the heaviest leaves the light ones to fill the last wave (the 32k prompt above: 426 vs
# 418 TFLOP/s in the long configuration, 347 vs 350 in the short one: a wash there).
# `extend_tiles` orders a tile map the same way; this flag is for the grid without one.
HEAVY_FIRST = True
# Long launches on Hopper over a bf16/fp16 pool go to the Gluon kernel (attention_extend_wgmma),
# which overlaps each key block's softmax with the tensor cores' work; False keeps them here.
WGMMA_LONG = True


def launch_config(
    max_extend_len: int, on_gpu: bool, fp8: bool = False
) -> tuple[int, int, int, int, int | None]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, register cap) for a launch whose longest
    extend is given, over an fp8 pool or not."""
    if not on_gpu:
        return 16, 16, 4, 2, None
    if max_extend_len >= LONG_EXTEND:
        return LONG_CONFIG
    return SHORT_CONFIGS["fp8" if fp8 else "bf16"]


@triton.jit
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    page_table_ptr,
    table_idx_ptr,
    prefix_lens_ptr,
    seq_lens_ptr,
    cu_extend_lens_ptr,
    tiles_ptr,
    k_scale_ptr,
    v_scale_ptr,
    sm_scale_log2,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_page_row,
    stride_tiles,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
    TILED: tl.constexpr,
    WINDOW: tl.constexpr,
):
    if TILED:  # tiles_ptr: [2, stride_tiles] int32, row 0 the request, row 1 its query block
        b = tl.load(tiles_ptr + tl.program_id(0))
        block_m = tl.load(tiles_ptr + stride_tiles + tl.program_id(0))
        head = tl.program_id(1)
    else:
        block_m = tl.program_id(0)
        if HEAVY_FIRST:
            block_m = tl.num_programs(0) - 1 - block_m
        b = tl.program_id(1)
        head = tl.program_id(2)

    q_start = tl.load(cu_extend_lens_ptr + b)
    extend_len = tl.load(cu_extend_lens_ptr + b + 1) - q_start
    if block_m * BLOCK_M >= extend_len:
        return
    prefix = tl.load(prefix_lens_ptr + b)
    seq_len = tl.load(seq_lens_ptr + b)
    row = tl.load(table_idx_ptr + b).to(tl.int64)
    kv_head = head // GROUP

    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < extend_len
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q_pos = prefix + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if KV_SCALED:  # an fp8 cache: K's scale folds into the scores, V's into the output
        sm_scale_log2 = sm_scale_log2 * tl.load(k_scale_ptr + kv_head)
        q = fp8_pool_operand(q)
    page_row = page_table_ptr + row * stride_page_row
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    # Keys before the block's first query position are visible to every row: whole key blocks of
    # them need neither bounds nor causal masks. The rest, up to the last row's position, do.
    unmasked_end = (prefix + block_m * BLOCK_M) // BLOCK_N * BLOCK_N
    end = tl.minimum(seq_len, prefix + (block_m + 1) * BLOCK_M)
    first = 0
    if WINDOW > 0:  # row i sees keys (q_pos[i] - WINDOW, q_pos[i]]: every block masked both ways
        first = tl.maximum(prefix + block_m * BLOCK_M - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        unmasked_end = first
    # Without a window every row sees key 0, so after the first block every row's maximum is finite.
    m_i, l_i, acc = attend_blocks(
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
        first,
        unmasked_end,
        sm_scale_log2,
        offs_n,
        offs_d,
        d_mask,
        False,
        True,
        BLOCK_N,
        0,
    )
    m_i, l_i, acc = attend_blocks(
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
        unmasked_end,
        end,
        sm_scale_log2,
        offs_n,
        offs_d,
        d_mask,
        True,
        True,
        BLOCK_N,
        WINDOW,
    )

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_SCALED:
        o = o * tl.load(v_scale_ptr + kv_head)
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def extend_tiles(extend_lens: list[int], block_m: int, width: int | None = None) -> list[list[int]]:
    """The tile map of a pass: [requests, query blocks], one column per program. Each request's
    blocks run last-first: under the causal mask a later block sees more keys, so starting with
    the heaviest leaves the light ones to fill the last wave. The map is padded to `width`
    (default: the tile count rounded up to 16) with tiles past request 0's end, which return at
    once; a width that is a multiple of 16 keeps the kernel's row-stride argument in one Triton
    specialization, so no pass compiles a new variant."""
    requests: list[int] = []
    blocks: list[int] = []
    for i, n in enumerate(extend_lens):
        count = -(-n // block_m)
        requests += [i] * count
        blocks += range(count - 1, -1, -1)
    width = -(-len(requests) // 16) * 16 if width is None else width
    if width % 16 or width < len(requests):
        raise ValueError(f"tile map width {width} must be a multiple of 16 holding {len(requests)} tiles")
    pad = width - len(requests)
    return [requests + [0] * pad, blocks + [-(-extend_lens[0] // block_m)] * pad]


def extend_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    table_idx: torch.Tensor,
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_extend_lens: torch.Tensor,
    max_extend_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    tiles: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its keys [0, seq_lens[b]); with a
    sliding `window`, the query at position i over keys (i - window, i] only.

    q: [T, Hq, D] (last dim contiguous); k_pool, v_pool: [slots, Hk, D]; page_table: [rows, max_len]
    int32; table_idx, prefix_lens, seq_lens: [B] int32 and cu_extend_lens: [B + 1] int32, all on
    the device; max_extend_len: the longest extend of the batch (CPU int: it picks the launch
    configuration, and without a tile map it sizes the grid). An fp8 pool comes with k_scale,
    v_scale ([Hk] float32; see decode_attention). tiles: the pass's `extend_tiles` for this
    launch's BLOCK_M (`launch_config`), [2, width] int32 on the device, contiguous.
    Returns [T, Hq, D] in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num q heads {num_heads} is not a multiple of num kv heads {num_kv_heads}")
    assert q.stride(-1) == 1 and k_pool.stride(-1) == 1 and v_pool.stride(-1) == 1
    assert page_table.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    batch = table_idx.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    block_m, block_n, num_warps, num_stages, cap = launch_config(
        max_extend_len, q.is_cuda, k_scale is not None
    )
    if tiles is not None:
        assert tiles.is_contiguous() and tiles.shape[0] == 2 and tiles.shape[1] % 16 == 0
        grid = (tiles.shape[1], num_heads)
    else:
        grid = (triton.cdiv(max_extend_len, block_m), batch, num_heads)
    if (
        WGMMA_LONG
        and attention_extend_wgmma is not None
        and max_extend_len >= LONG_EXTEND
        and block_m == attention_extend_wgmma.CONFIG[0]  # the block size the grid and tiles are for
        and attention_extend_wgmma.applies(q, k_pool, window)  # (an fp8 pool is not q's dtype)
        and attention_extend_wgmma.extend_attention_wgmma(
            q,
            k_pool,
            v_pool,
            out,
            page_table,
            table_idx,
            prefix_lens,
            seq_lens,
            cu_extend_lens,
            scale,
            tiles,
            grid,
            HEAVY_FIRST,
        )  # fmt: skip
    ):
        return out
    register_cap = {"maxnreg": cap} if cap else {}
    _extend_kernel[grid](
        q,
        k_pool,
        v_pool,
        out,
        page_table,
        table_idx,
        prefix_lens,
        seq_lens,
        cu_extend_lens,
        tiles if tiles is not None else seq_lens,
        k_scale if k_scale is not None else seq_lens,
        v_scale if v_scale is not None else seq_lens,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        out.stride(0),
        out.stride(1),
        page_table.stride(0),
        tiles.stride(0) if tiles is not None else 16,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        KV_SCALED=k_scale is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        HEAVY_FIRST=HEAVY_FIRST,
        TILED=tiles is not None,
        WINDOW=window or 0,
        num_warps=num_warps,
        num_stages=num_stages,
        **register_cap,
    )
    return out
