"""The small-batch split-K GEMM (minfer.kernels.gemm) against torch's matmul.

fp32 runs with true fp32 products, so it matches a float64 reference to fp32 rounding; half
types accumulate in fp32 and round once, so they are within one unit in the last place of the
float64 result rounded (two under Triton's interpreter, which truncates instead of rounding).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import gemm_tolerance

from minfer.kernels import gemm
from minfer.kernels.common import arrival_counters

# (M, N, K, config): configs force the split path, several K splits with a ragged last block,
# tiles that overhang M and N, and the single-split path.
CASES = [
    (3, 40, 96, None),
    (5, 64, 512, (16, 64, 128, 4, 4, 3)),
    (17, 70, 300, (16, 32, 64, 3, 4, 3)),
    (33, 48, 200, (32, 32, 32, 1, 4, 2)),
    (1, 32, 64, None),
]


def _inputs(m, n, k, dtype, device, seed, row_stride=None):
    gen = torch.Generator().manual_seed(seed)
    width = row_stride or k
    x = torch.randn((m, width), generator=gen).to(dtype).to(device)[:, :k]  # strided rows when width > k
    w = torch.randn((n, k), generator=gen).to(dtype).to(device)
    bias = torch.randn((n,), generator=gen).to(dtype).to(device)
    return x, w, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,config", CASES)
def test_gemm_matches_torch(m, n, k, config, dtype, device):
    x, w, bias = _inputs(m, n, k, dtype, device, seed=m + n + k, row_stride=k + 8)
    for b in (None, bias):
        out = gemm.linear(x, w, b, config=config)
        expected = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert out.dtype == dtype and out.shape == (m, n)
        torch.testing.assert_close(out.double(), expected.to(dtype).double(), **gemm_tolerance(dtype))
    # the last program of every split tile put its arrival counter back to zero
    assert int(arrival_counters(x.device, "gemm", gemm._MAX_TILES).abs().sum()) == 0


def test_gemm_split_sum_is_deterministic(device):
    """Split partials are added in split order whichever program finishes last."""
    x, w, _ = _inputs(64, 256, 1024, torch.bfloat16, device, seed=1)
    config = (16, 64, 64, 8, 4, 2)
    first = gemm.linear(x, w, config=config)
    for _ in range(3):
        assert torch.equal(gemm.linear(x, w, config=config), first)


def test_gemm_keeps_leading_dims_and_empty_input(device):
    x, w, _ = _inputs(6, 24, 32, torch.float32, device, seed=2)
    out = gemm.linear(x.reshape(2, 3, 32), w)
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(out.reshape(6, 24), F.linear(x, w), atol=1e-4, rtol=1e-5)
    assert gemm.linear(x[:0], w).shape == (0, 24)
    with pytest.raises(ValueError, match="features"):
        gemm.linear(x, w[:, :16])


def test_choose_config_fills_the_gpu():
    """One or two programs per SM for decode shapes; no split when the tiles alone fill it."""
    for m, n, k in [(1, 1024, 2048), (256, 1024, 3072), (16, 4096, 1024)]:
        bm, bn, bk, split, _, _ = gemm.choose_config(m, n, k, num_sms=132)
        programs = -(-m // bm) * -(-n // bn) * split
        assert 64 <= programs <= 2 * 132 and k // bk >= 2 * split or split == 1
    assert gemm.choose_config(256, 28672, 4096, num_sms=132)[3] == 1


def test_choose_config_keeps_k_slices_short():
    """Tiles that fill the GPU with few splits still cut K into slices of MAX_K_PER_SPLIT."""
    # Qwen3-30B-A3B's o_proj at one row: 64 tiles, so 2 splits would fill the SMs
    bm, bn, bk, split, _, _ = gemm.choose_config(1, 2048, 4096, num_sms=132)
    assert split == 4096 // gemm.MAX_K_PER_SPLIT
    assert gemm.choose_config(1, 4096, 1024, num_sms=132)[3] == 1  # one slice already
    # never more than two programs per SM for it: 128 tiles of 256 rows leave room for 2 splits
    assert gemm.choose_config(256, 1024, 4096, num_sms=132)[3] == 2


def test_suits_only_the_measured_shapes():
    """Decode batches of up to 64 rows on Qwen3-0.6B-sized weights; cuBLAS for the rest."""
    gate_up = torch.empty((6144, 1024), device="meta")
    assert gemm.suits(1, gate_up) and gemm.suits(64, gate_up)
    assert not gemm.suits(65, gate_up)
    assert not gemm.suits(1, torch.empty((4096, 4096), device="meta"))  # Llama-8B o_proj


@pytest.mark.gpu
def test_gemm_replays_in_a_cuda_graph():
    device = torch.device("cuda")
    x, w, bias = _inputs(48, 1024, 2048, torch.bfloat16, device, seed=3)
    static_x = x.clone()
    out = gemm.linear(static_x, w, bias)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemm.linear(static_x, w, bias)
    for seed in (4, 5):
        static_x.copy_(_inputs(48, 1024, 2048, torch.bfloat16, device, seed=seed)[0])
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, gemm.linear(static_x, w, bias), atol=0, rtol=0)
        torch.testing.assert_close(out.float(), F.linear(static_x, w, bias).float(), atol=5e-2, rtol=2e-2)
