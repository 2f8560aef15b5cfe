"""Paged decode and extend attention kernels against the torch references and TorchAttentionBackend."""

from __future__ import annotations

import subprocess
import sys
import zlib

import pytest
import torch
from kernel_cases import make_paged_batch, tolerance

from minfer.attention.base import ForwardContext, build_metadata
from minfer.attention.torch_backend import TorchAttentionBackend
from minfer.attention.triton_backend import TritonAttentionBackend
from minfer.kernels import attention_extend, attention_extend_wgmma
from minfer.kernels.attention_decode import choose_num_splits, decode_attention
from minfer.kernels.attention_extend import extend_attention, extend_tiles
from minfer.kernels.attention_reference import decode_attention_reference, extend_attention_reference
from minfer.kvcache.pool import KVPool


def _generator(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _decode_case(group, head_dim, page_size, dtype, device, seq_lens, num_kv_heads=2):
    gen = _generator(group, head_dim, page_size, str(dtype), tuple(seq_lens))
    batch = make_paged_batch(
        [s - 1 for s in seq_lens], [1] * len(seq_lens), num_kv_heads, head_dim, page_size, dtype, device, gen
    )
    q = torch.randn((len(seq_lens), num_kv_heads * group, head_dim), generator=gen).to(dtype).to(device)
    return batch, q


def _decode_args(batch, q, scale):
    return q, batch.k_pool, batch.v_pool, batch.page_table, batch.table_idx, batch.seq_lens, scale


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_decode_matches_reference(group, head_dim, page_size, device):
    dtype = torch.bfloat16
    batch, q = _decode_case(group, head_dim, page_size, dtype, device, [1, 37, 130, 64])
    args = _decode_args(batch, q, head_dim**-0.5)
    expected = decode_attention_reference(*args)
    for num_splits in (1, 3):
        out = decode_attention(*args, num_splits=num_splits)
        torch.testing.assert_close(out, expected, **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_dtypes(dtype, device):
    batch, q = _decode_case(2, 64, 16, dtype, device, [5, 90])
    args = _decode_args(batch, q, 0.125)
    out = decode_attention(*args, num_splits=2)
    assert out.dtype == dtype
    torch.testing.assert_close(out, decode_attention_reference(*args), **tolerance(dtype))


def test_decode_more_splits_than_keys(device):
    """Splits past the end of a short sequence are empty and must not disturb the merge."""
    batch, q = _decode_case(4, 64, 1, torch.float32, device, [1, 3, 200])
    args = _decode_args(batch, q, 0.125)
    expected = decode_attention_reference(*args)
    for num_splits in (5, 16):
        out = decode_attention(*args, num_splits=num_splits)
        torch.testing.assert_close(out, expected, **tolerance(torch.float32))


def test_num_splits_depend_only_on_static_sizes(device):
    assert choose_num_splits(1, 1, 40960, device) > 1  # one request alone is spread out
    assert choose_num_splits(1, 8, 40960, device) >= choose_num_splits(256, 8, 40960, device)
    assert choose_num_splits(256, 8, 40960, device) == 1  # a big batch fills the GPU by itself
    assert choose_num_splits(1, 1, 64, device) == 1  # never more splits than key blocks
    assert choose_num_splits(1, 1, 10**6, device) <= 64


def _extend_case(group, head_dim, page_size, dtype, device, prefix_lens, extend_lens, num_kv_heads=2):
    gen = _generator(group, head_dim, page_size, str(dtype), tuple(prefix_lens), tuple(extend_lens))
    batch = make_paged_batch(prefix_lens, extend_lens, num_kv_heads, head_dim, page_size, dtype, device, gen)
    q = torch.randn((sum(extend_lens), num_kv_heads * group, head_dim), generator=gen).to(dtype).to(device)
    return batch, q


def _run_extend(batch, q, scale, tiled=True, width=None):
    """Through a tile map, as the engine launches it (`width` pads the map as a CUDA graph's
    fixed one is), or over the grid sized by the longest extend."""
    longest = max(batch.extend_lens_cpu)
    tiles = None
    if tiled:
        block_m = attention_extend.launch_config(longest, q.is_cuda)[0]
        tiles = torch.tensor(extend_tiles(batch.extend_lens_cpu, block_m, width), dtype=torch.int32)
    return extend_attention(
        q,
        batch.k_pool,
        batch.v_pool,
        batch.page_table,
        batch.table_idx,
        batch.prefix_lens,
        batch.seq_lens,
        batch.cu_extend_lens,
        longest,
        scale,
        tiles=None if tiles is None else tiles.to(q.device),
    )


def _extend_reference(batch, q, scale):
    return extend_attention_reference(
        q,
        batch.k_pool,
        batch.v_pool,
        batch.page_table,
        batch.table_idx,
        batch.prefix_lens,
        batch.seq_lens,
        scale,
    )


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_extend_matches_reference(group, head_dim, page_size, device):
    dtype = torch.bfloat16
    # prefix 0 (plain prefill), prefix > 0 (cached prefix), one-token extend, extends over blocks
    batch, q = _extend_case(group, head_dim, page_size, dtype, device, [0, 21, 40, 3], [19, 1, 35, 6])
    scale = head_dim**-0.5
    expected = _extend_reference(batch, q, scale)
    torch.testing.assert_close(_run_extend(batch, q, scale), expected, **tolerance(dtype))
    if group == 2 and page_size == 16:  # the grid without a tile map, and a padded map
        torch.testing.assert_close(_run_extend(batch, q, scale, tiled=False), expected, **tolerance(dtype))
        torch.testing.assert_close(_run_extend(batch, q, scale, width=64), expected, **tolerance(dtype))


def test_extend_tiles_cover_every_query_block_once():
    """Each request's blocks last-first, then padding past request 0's end up to a multiple of
    16 (one Triton specialization for the row stride); a width too small or unaligned fails."""
    requests, blocks = extend_tiles([130, 1, 64], 64)
    assert list(zip(requests, blocks))[:5] == [(0, 2), (0, 1), (0, 0), (1, 0), (2, 0)]
    assert len(requests) == 16 and set(zip(requests[5:], blocks[5:])) == {(0, 3)}
    assert len(extend_tiles([130, 1, 64], 64, width=48)[0]) == 48
    for width in (0, 20):
        with pytest.raises(ValueError, match="tile map width"):
            extend_tiles([130, 1, 64], 64, width=width)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_extend_dtypes(dtype, device):
    batch, q = _extend_case(2, 64, 16, dtype, device, [17, 0], [23, 9])
    out = _run_extend(batch, q, 0.125)
    assert out.dtype == dtype
    torch.testing.assert_close(out, _extend_reference(batch, q, 0.125), **tolerance(dtype))


def _context(batch, is_decode, num_kv_heads, head_dim, dtype, device) -> ForwardContext:
    meta = build_metadata(
        batch.table_idx_cpu, batch.prefix_lens_cpu, batch.extend_lens_cpu, batch.page_table, is_decode, device
    )
    pool = KVPool(1, batch.k_pool.shape[0] - 1, num_kv_heads, head_dim, 1, dtype, device)
    pool.k[0], pool.v[0] = batch.k_pool, batch.v_pool
    return ForwardContext(attn=meta, kv_pool=pool, backend=TritonAttentionBackend(), out_loc=torch.empty(0))


@pytest.mark.parametrize("is_decode", [True, False])
def test_backend_matches_torch_backend(is_decode, device):
    dtype, num_kv_heads, head_dim = torch.float32, 2, 64
    if is_decode:
        batch, q = _decode_case(2, head_dim, 16, dtype, device, [12, 70, 33], num_kv_heads=num_kv_heads)
    else:
        batch, q = _extend_case(
            2, head_dim, 16, dtype, device, [0, 30, 5], [11, 4, 20], num_kv_heads=num_kv_heads
        )
    ctx = _context(batch, is_decode, num_kv_heads, head_dim, dtype, device)
    out = TritonAttentionBackend().forward(q, 0, ctx, head_dim**-0.5)
    expected = TorchAttentionBackend().forward(q, 0, ctx, head_dim**-0.5)
    torch.testing.assert_close(out, expected, **tolerance(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 8), (32, 8)])
def test_decode_long_context_gpu(num_heads, num_kv_heads):
    device = torch.device("cuda")
    seq_lens = [40_000, 1, 2048, 17_001]
    batch, q = _decode_case(
        num_heads // num_kv_heads, 128, 16, torch.bfloat16, device, seq_lens, num_kv_heads=num_kv_heads
    )
    args = _decode_args(batch, q, 128**-0.5)
    expected = decode_attention_reference(*args)
    torch.testing.assert_close(decode_attention(*args), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
def test_decode_cuda_graph_replay_sees_new_lengths():
    """Capture once, then change lengths and page table in place: the replay must follow them."""
    device = torch.device("cuda")
    gen = _generator("graph")
    batch = make_paged_batch(
        [99, 4000, 17], [1, 1, 1], 8, 128, 16, torch.bfloat16, device, gen, table_width=8192
    )
    q = torch.randn((3, 16, 128), generator=gen).to(torch.bfloat16).to(device)
    args = _decode_args(batch, q, 128**-0.5)
    out = decode_attention(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(*args)
    batch.seq_lens.copy_(torch.tensor([3000, 50, 8000], dtype=torch.int32))
    batch.page_table.copy_(
        torch.randint(0, batch.k_pool.shape[0], batch.page_table.shape, generator=gen, dtype=torch.int32)
    )
    q.copy_(torch.randn(q.shape, generator=gen))
    graph.replay()
    torch.testing.assert_close(out, decode_attention_reference(*args), atol=1e-2, rtol=1e-2)


def test_extend_launch_config_follows_the_longest_extend():
    """Long prompts' chunks get the large tiles, packed short prompts the small ones; the CPU
    interpreter always runs 16 x 16 blocks."""
    long_from = attention_extend.LONG_EXTEND
    assert attention_extend.launch_config(long_from - 1, True) == attention_extend.SHORT_CONFIGS["bf16"]
    assert (
        attention_extend.launch_config(long_from - 1, True, fp8=True) == attention_extend.SHORT_CONFIGS["fp8"]
    )
    assert attention_extend.launch_config(long_from, True) == attention_extend.LONG_CONFIG
    assert attention_extend.launch_config(long_from, True, fp8=True) == attention_extend.LONG_CONFIG
    assert attention_extend.launch_config(long_from, False)[:2] == (16, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 8), (32, 8)])
def test_extend_real_shapes_gpu(num_heads, num_kv_heads):
    device = torch.device("cuda")
    batch, q = _extend_case(
        num_heads // num_kv_heads,
        128,
        16,
        torch.bfloat16,
        device,
        [0, 1500, 64, 0],
        [2048, 300, 1, 700],
        num_kv_heads=num_kv_heads,
    )
    torch.testing.assert_close(
        _run_extend(batch, q, 128**-0.5), _extend_reference(batch, q, 128**-0.5), atol=1e-2, rtol=1e-2
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tiled", [True, False])
def test_extend_long_wgmma_gpu(dtype, tiled, monkeypatch):
    """Long launches on Hopper take the Gluon kernel (attention_extend_wgmma): it matches the
    reference and the Triton kernel, over prefixes that do not start on a key block, a one-token
    extend beside long ones, and an odd and an even number of key blocks per query block."""
    device = torch.device("cuda")
    if not attention_extend_wgmma.supported(device):
        pytest.skip("the Gluon kernel needs an sm_90 GPU")
    batch, q = _extend_case(4, 128, 16, dtype, device, [0, 37, 1000, 5], [1600, 1, 1700, 130])
    scale = 128**-0.5
    out = _run_extend(batch, q, scale, tiled=tiled)
    torch.testing.assert_close(out, _extend_reference(batch, q, scale), atol=1e-2, rtol=1e-2)
    monkeypatch.setattr(attention_extend, "WGMMA_LONG", False)
    torch.testing.assert_close(out, _run_extend(batch, q, scale, tiled=tiled), atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 128])
def test_extend_long_wgmma_runs_gpu(page_size):
    """The Gluon kernel's producer copies a key block whose pool slots are consecutive as one TMA
    box and any other block row by row: pages of 1, shuffled, are all row copies; pages of 128
    make every full block one box, and the last block of each request (partial) row copies."""
    device = torch.device("cuda")
    if not attention_extend_wgmma.supported(device):
        pytest.skip("the Gluon kernel needs an sm_90 GPU")
    batch, q = _extend_case(4, 128, page_size, torch.bfloat16, device, [0, 300, 1001], [1600, 1700, 40])
    scale = 128**-0.5
    torch.testing.assert_close(
        _run_extend(batch, q, scale, tiled=True), _extend_reference(batch, q, scale), atol=1e-2, rtol=1e-2
    )


@pytest.mark.gpu
def test_extend_long_wgmma_scores_that_climb_gpu():
    """The Gluon kernel moves a row's running max only once a score passes it by more than 2^8
    (the accumulators' rescale is skipped otherwise), so random scores, which never climb that far
    after the first key block, would never take the rescale. Here each request's scores follow a
    slope along the key positions: steep (the max moves by more than 2^8 in every block), gentle
    (now and then) and falling (never after the first block)."""
    device = torch.device("cuda")
    if not attention_extend_wgmma.supported(device):
        pytest.skip("the Gluon kernel needs an sm_90 GPU")
    batch, q = _extend_case(4, 128, 16, torch.bfloat16, device, [0, 300, 200], [1700, 1600, 1536])
    scale = 128**-0.5
    # q and every key lean along the all-ones direction, so a key's score is ~ slope x position
    # plus noise; slopes in nats per key (a 128-key block: 6.4, 0.5 and -2.6 nats)
    q.mul_(0.3).add_(1.0)
    requests = zip(batch.table_idx_cpu, batch.prefix_lens_cpu, batch.extend_lens_cpu, (0.05, 0.004, -0.02))
    for row, prefix_len, extend_len, slope in requests:
        seq_len = prefix_len + extend_len
        slots = batch.page_table[row, :seq_len].long()
        lean = slope / (scale * 128) * torch.arange(seq_len, device=device, dtype=torch.float32)
        batch.k_pool[slots] = (0.3 * batch.k_pool[slots].float() + lean[:, None, None]).to(batch.k_pool.dtype)
    out = _run_extend(batch, q, scale, tiled=True)
    torch.testing.assert_close(out, _extend_reference(batch, q, scale), atol=1e-2, rtol=1e-2)


def test_gluon_extend_launch_failure_falls_back(monkeypatch, caplog):
    """A Gluon launch that raises (on this machine: no GPU to compile for) returns False with one
    warning, and the kernel stays off, so every long prefill after it runs the Triton kernel
    rather than failing its request."""
    monkeypatch.setattr(attention_extend_wgmma, "_disabled", None)
    batch, q = _extend_case(4, 128, 16, torch.bfloat16, torch.device("cpu"), [0], [40])
    launched = attention_extend_wgmma.extend_attention_wgmma(
        q, batch.k_pool, batch.v_pool, torch.empty_like(q), batch.page_table, batch.table_idx,
        batch.prefix_lens, batch.seq_lens, batch.cu_extend_lens, 128**-0.5, None, (1, 1, 8), True,
    )  # fmt: skip
    assert not launched and attention_extend_wgmma._disabled
    assert "Gluon extend kernel failed" in caplog.text
    assert not attention_extend_wgmma.applies(q, batch.k_pool, None)


def test_extend_imports_on_a_triton_without_gluon():
    """minfer allows Triton releases from before Gluon: there the extend module still imports and
    every launch stays on the Triton kernel (a subprocess, where Gluon's import is made to fail)."""
    code = (
        "import sys; sys.modules['triton.experimental.gluon'] = None\n"
        "from minfer.kernels import attention_extend\n"
        "assert attention_extend.attention_extend_wgmma is None\n"
        "print('imported')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "imported" in result.stdout, result.stderr[-2000:]
