"""The few-row GEMV (minfer.kernels.gemv) against a float64 matmul, and its routing.

Half types accumulate in fp32 and round once, so they are within one unit in the last place of
the float64 result rounded (two under Triton's interpreter, which truncates instead of rounding).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import gemm_tolerance

from minfer.kernels import gemv

# (M, N, K, config): K not a power of two (masked tail of the slice), N not a multiple of the
# block, one output row per program, and the default configuration.
CASES = [
    (1, 40, 96, None),
    (2, 64, 300, (16, 512, 4)),
    (2, 37, 1000, (1, 1024, 4)),
    (2, 130, 64, (64, 64, 4)),
    (1, 1024, 3072, None),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,config", CASES)
def test_gemv_matches_float64(m, n, k, config, dtype, device):
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn((m, k + 8), generator=gen).to(dtype).to(device)[:, :k]  # strided rows
    w = torch.randn((n, k), generator=gen).to(dtype).to(device)
    bias = torch.randn((n,), generator=gen).to(dtype).to(device)
    for b in (None, bias):
        out = gemv.gemv(x, w, b, config=config)
        expected = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert out.dtype == dtype and out.shape == (m, n)
        torch.testing.assert_close(out.double(), expected.to(dtype).double(), **gemm_tolerance(dtype))


def test_gemv_keeps_leading_dims_and_refuses_what_it_cannot_hold(device):
    x = torch.randn(1, 2, 32, device=device)
    w = torch.randn(24, 32, device=device)
    torch.testing.assert_close(gemv.gemv(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)
    assert gemv.gemv(x[:, :0], w).shape == (1, 0, 24)
    with pytest.raises(ValueError, match="features"):
        gemv.gemv(x, w[:, :16])
    with pytest.raises(ValueError, match="rows"):
        gemv.gemv(torch.randn(gemv.MAX_ROWS + 1, 32, device=device), w)


def test_choose_config_keeps_slices_in_registers_and_fills_the_gpu():
    """At most 16k weights per program (8k at two rows), K whole, and 1.5 programs per SM where
    N allows it."""
    for rows in (1, 2):
        for n, k in [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (28672, 4096), (4096, 14336)]:
            block_n, block_k, _ = gemv.choose_config(n, k, num_sms=132, rows=rows)
            assert block_k >= k and (block_n * block_k <= 16384 // rows or block_n == 1)
            assert -(-n // block_n) >= 198 or block_n == 1
    assert gemv.choose_config(1024, 2048, num_sms=132) == (4, 2048, 8)  # 256 programs, not 128
    assert gemv.choose_config(1024, 2048, num_sms=132, rows=2) == (4, 2048, 4)


def test_suits_one_row_and_two_rows_of_moderate_k():
    w = torch.empty((6144, 1024), device="meta")
    assert gemv.suits(1, w) and gemv.suits(2, w)
    assert not gemv.suits(3, w) and not gemv.suits(0, w)
    assert gemv.suits(1, torch.empty((4096, 14336), device="meta"))  # Llama-8B down, one row
    assert not gemv.suits(2, torch.empty((4096, 14336), device="meta"))  # cuBLAS wins at two
    assert not gemv.suits(1, torch.empty((16, gemv.MAX_K + 1), device="meta"))


@pytest.mark.gpu
def test_gemv_after_a_releasing_kernel_in_a_cuda_graph():
    """The gemv starts early after an RMSNorm that releases it (programmatic dependent launch)
    and still reads the norm's output, replay after replay; and its result equals eager's."""
    from minfer.kernels.norm import rmsnorm

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(5)
    h = torch.randn((1, 1024), generator=gen).to(torch.bfloat16).to(device)
    norm_w = torch.randn(1024, generator=gen).to(torch.bfloat16).to(device)
    w = torch.randn((4096, 1024), generator=gen).to(torch.bfloat16).to(device)
    out = gemv.gemv(rmsnorm(h, norm_w, 1e-6), w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv.gemv(rmsnorm(h, norm_w, 1e-6), w)
    for seed in (6, 7, 8):
        h.copy_(torch.randn((1, 1024), generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        eager = gemv.gemv(rmsnorm(h, norm_w, 1e-6), w)
        torch.testing.assert_close(out, eager, atol=0, rtol=0)
        torch.testing.assert_close(
            out.float(), F.linear(rmsnorm(h, norm_w, 1e-6), w).float(), atol=0.5, rtol=2e-2
        )


def test_pdl_is_off_where_it_cannot_run(monkeypatch):
    """The interpreter and CPU tensors never get the launch attribute or the wait/release
    instructions, whatever MINFER_PDL says (they exist only on compiled Hopper+ kernels)."""
    from minfer.kernels import common

    monkeypatch.setenv("MINFER_PDL", "chain")
    common.reset_pdl_choice()
    try:
        assert common.pdl_args(torch.device("cpu")) == {"PDL_RELEASE": False, "PDL_WAIT": False}
    finally:
        common.reset_pdl_choice()
