"""The few-row GEMV (minfer.kernels.gemv) against a float64 matmul, and its routing.

Half types accumulate in fp32 and round once, so they are within one unit in the last place of
the float64 result rounded (two under Triton's interpreter, which truncates instead of rounding).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import gemm_tolerance

from minfer.kernels import common, gemv, pdl

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


@pytest.mark.parametrize("rows", [1, 2])
def test_gemv_writes_float32_logits_into_out(rows, device):
    """The LM head's form: bf16 operands, the fp32 sum written unrounded into a given buffer."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn((rows, 200), generator=gen).to(torch.bfloat16).to(device)
    w = (torch.randn((333, 200), generator=gen) / 14).to(torch.bfloat16).to(device)
    out = torch.full((rows, 333), float("nan"), device=device)
    assert gemv.gemv(x, w, out=out) is not None
    expected = F.linear(x.double(), w.double())
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)  # no bf16 rounding
    with pytest.raises(ValueError, match="out must be"):
        gemv.gemv(x, w, out=torch.empty((rows, 333), dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match="out must be"):
        gemv.gemv(x, w, out=torch.empty((rows, 332), device=device))


def test_the_lm_head_takes_gemv_for_one_or_two_rows(monkeypatch, device):
    """ParallelLMHead routed as on a GPU (the interpreter off one): one and two rows go through
    gemv into the float32 logits, with or without the graph's buffer; more rows stay on torch."""
    from minfer.layers import embedding

    torch.manual_seed(4)
    head = embedding.ParallelLMHead(300, 64).to(device)
    head.weight.data = (torch.randn(300, 64) / 8).to(torch.bfloat16).to(device)
    launched = []
    monkeypatch.setattr(embedding, "on_triton", lambda x: True)
    real_gemv = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda *a, **kw: launched.append(a[0].shape[0]) or real_gemv(*a, **kw))
    for rows in (1, 2, 3):
        hidden = torch.randn((rows, 64), device=device).to(torch.bfloat16)
        expected = F.linear(hidden.double(), head.weight.double())
        logits = head.compute_logits(hidden)
        buffer = torch.empty((rows, 300), device=device)
        returned = head.compute_logits(hidden, out=buffer)
        assert returned.data_ptr() == buffer.data_ptr()
        for got in (logits, buffer):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got.double(), expected, atol=1e-2, rtol=1e-2)
    assert launched == [1, 1, 2, 2]


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
    monkeypatch.setenv("MINFER_PDL", "chain")
    pdl.reset_pdl_choice()
    try:
        for rows in (1, 256):
            assert pdl.pdl_args(torch.device("cpu"), rows) == {"PDL_RELEASE": False, "PDL_WAIT": False}
    finally:
        pdl.reset_pdl_choice()


@pytest.mark.skipif(
    not torch.cuda.is_available()
    or torch.cuda.get_device_capability()[0] < 9
    or bool(common.INTERPRET.value),
    reason="programmatic dependent launch needs a compiled Hopper+ kernel",
)
@pytest.mark.parametrize(
    "mode, chained_rows",
    [("1", (1, 2)), ("late", (1, 2)), ("chain", (1, 2, 3, 256)), ("release", ()), ("0", ())],
)
def test_pdl_modes_chain_the_launches_they_name(monkeypatch, mode, chained_rows):
    """MINFER_PDL's modes on a GPU: the default chains launches of at most CHAIN_ROWS rows and
    releases every launch ("late" the same, releasing after the wait: a compile-time constant,
    EARLY_RELEASE); "chain" chains all of them, "release" none, "0" turns PDL off."""
    monkeypatch.setenv("MINFER_PDL", mode)
    pdl.reset_pdl_choice()
    try:
        for rows in (1, 2, 3, 256):
            args = pdl.pdl_args(torch.device("cuda"), rows)
            assert args["PDL_WAIT"] == (rows in chained_rows) == args.get("launch_pdl", False)
            assert args["PDL_RELEASE"] == (mode != "0")
    finally:
        pdl.reset_pdl_choice()


def test_chain_bands_name_the_rows_they_chain(monkeypatch):
    assert pdl.parse_chain_bands("1-2") == ((1, 2),)
    monkeypatch.setattr(pdl, "CHAIN_BANDS", pdl.parse_chain_bands(pdl.DEFAULT_CHAIN_BANDS))
    chained = [rows for rows in (1, 2, 3, 16, 32, 33, 48, 64, 65, 256) if pdl.chained_rows(rows)]
    assert chained == [1, 2, 33, 48, 64]  # not the 32-row graph, which batches of 17-31 replay
    monkeypatch.setattr(pdl, "CHAIN_BANDS", pdl.parse_chain_bands("1-2, 32-64"))
    assert [rows for rows in (1, 2, 3, 31, 32, 64, 65) if pdl.chained_rows(rows)] == [1, 2, 32, 64]
    for bad in ("", "2", "3-1", "0-2", "1-x", "1-2;4-5"):
        with pytest.raises(ValueError, match="MINFER_CHAIN_BANDS"):
            pdl.parse_chain_bands(bad)


def test_an_unknown_pdl_mode_is_refused(monkeypatch):
    monkeypatch.setenv("MINFER_PDL", "yes")
    pdl.reset_pdl_choice()
    try:
        with pytest.raises(ValueError, match="MINFER_PDL='yes'"):
            pdl.pdl_args(torch.device("cpu"), 1)
    finally:
        pdl.reset_pdl_choice()


# (M, N, K, config) for the prologues: a masked tail of K, one output row per program.
PROLOGUE_CASES = [(1, 40, 96, None), (2, 37, 300, (1, 512, 4)), (2, 130, 64, (64, 64, 4))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,config", PROLOGUE_CASES)
def test_normed_gemv_is_the_norm_then_the_gemv(m, n, k, config, dtype, device):
    """The RMSNorm prologue returns what minfer.kernels.norm.rmsnorm followed by gemv returns:
    the residual stream exactly, the product within the GEMM tolerance (the sum of squares may
    add up in another order, which can move the rounded norm output by one unit)."""
    from minfer.kernels.norm import rmsnorm

    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn((m, k + 8), generator=gen).to(dtype).to(device)[:, :k]  # strided rows
    residual = torch.randn((m, k), generator=gen).to(dtype).to(device)
    norm_w = torch.randn((k,), generator=gen).to(dtype).to(device)
    w = torch.randn((n, k), generator=gen).to(dtype).to(device)
    bias = torch.randn((n,), generator=gen).to(dtype).to(device)
    for res, b in ((None, None), (residual, None), (residual, bias)):
        out, summed = gemv.normed_gemv(x, w, norm_w, 1e-6, res, b, config=config)
        if res is None:
            normed, expected_summed = rmsnorm(x, norm_w, 1e-6), x
        else:
            normed, expected_summed = rmsnorm(x, norm_w, 1e-6, res)
        torch.testing.assert_close(summed, expected_summed, atol=0, rtol=0)
        expected = F.linear(normed.double(), w.double(), None if b is None else b.double())
        torch.testing.assert_close(out.double(), expected.to(dtype).double(), **_prologue_tolerance(dtype))
    with pytest.raises(ValueError, match="norm_weight"):
        gemv.normed_gemv(x, w, norm_w[:-1], 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,config", PROLOGUE_CASES)
def test_gated_gemv_is_silu_and_mul_then_the_gemv(m, n, k, config, dtype, device):
    from minfer.kernels.activation import silu_and_mul

    gen = torch.Generator().manual_seed(m + n * k)
    gate_up = torch.randn((m, 2 * k + 4), generator=gen).to(dtype).to(device)[:, : 2 * k]
    w = torch.randn((n, k), generator=gen).to(dtype).to(device)
    out = gemv.gated_gemv(gate_up, w, config=config)
    expected = F.linear(silu_and_mul(gate_up).double(), w.double())
    assert out.shape == (m, n) and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected.to(dtype).double(), **gemm_tolerance(dtype))
    with pytest.raises(ValueError, match="gate_up"):
        gemv.gated_gemv(gate_up[:, :-2], w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,config", PROLOGUE_CASES)
def test_gate_up_gemv_is_the_product_then_silu_and_mul(m, n, k, config, dtype, device):
    """The SiLU epilogue returns what the gate_up gemv (after the norm prologue, or plain)
    followed by minfer.kernels.activation.silu_and_mul returns: the stream exactly, the
    activation within the prologue tolerance (each factor rounds from its own fp32 sum)."""
    from minfer.kernels.activation import silu_and_mul

    gen = torch.Generator().manual_seed(3 * m + n + k)
    x = torch.randn((m, k + 8), generator=gen).to(dtype).to(device)[:, :k]  # strided rows
    residual = torch.randn((m, k), generator=gen).to(dtype).to(device)
    norm_w = torch.randn((k,), generator=gen).to(dtype).to(device)
    w = (torch.randn((2 * n, k), generator=gen) * k**-0.5).to(dtype).to(device)  # gate of order one
    bias = torch.randn((2 * n,), generator=gen).to(dtype).to(device)
    gated = None if config is None else (max(1, config[0] // 2), *config[1:])
    for norm, res, b in (
        (None, None, None),
        (None, None, bias),
        (norm_w, None, None),
        (norm_w, residual, bias),
    ):
        if norm is None:
            expected_gate_up, expected_stream = gemv.gemv(x, w, b, config=config), x
        else:
            expected_gate_up, expected_stream = gemv.normed_gemv(x, w, norm, 1e-6, res, b, config=config)
        out, stream = gemv.gate_up_gemv(x, w, norm, 1e-6, res, b, config=gated)
        assert out.shape == (m, n) and out.dtype == dtype
        torch.testing.assert_close(stream, expected_stream, atol=0, rtol=0)
        expected = silu_and_mul(expected_gate_up)
        torch.testing.assert_close(out.double(), expected.double(), **_prologue_tolerance(dtype))
    with pytest.raises(ValueError, match="gate"):
        gemv.gate_up_gemv(x, w[:-1])
    with pytest.raises(ValueError, match="residual"):
        gemv.gate_up_gemv(x, w, residual=residual)


def test_gated_config_keeps_the_unfused_grid_and_slice():
    """The epilogue's programs (gate and up rows each) are as many, and hold as many weights, as
    the unfused gate_up gemv's over its 2n rows (Qwen3-0.6B, Llama-3.1-8B, Qwen3-1.7B MLPs)."""
    for n, k in [(3072, 1024), (14336, 4096), (6144, 2048)]:
        for rows in (1, 2):
            block_n, block_k, warps = gemv.choose_config(2 * n, k, num_sms=132, rows=rows)
            gated_n, gated_k, gated_warps = gemv.gated_config(n, k, num_sms=132, rows=rows)
            assert -(-n // gated_n) == -(-2 * n // block_n)  # programs
            assert 2 * gated_n * gated_k == block_n * block_k and gated_warps == warps  # slice


def _prologue_tolerance(dtype):
    """The GEMM tolerance, plus (half types) a norm output one unit off on a few elements."""
    tol = gemm_tolerance(dtype)
    return tol if dtype == torch.float32 else {"atol": tol["atol"] * 4, "rtol": tol["rtol"] * 2}


def test_layers_fold_the_prologues_and_return_what_the_separate_steps_return(monkeypatch, device):
    """ColumnParallelLinear.forward_normed and LlamaMLP.forward_normed through the prologues
    (forced on: off a GPU they route to torch) against the same layers unfused. float32, so the
    comparison on CPU is not blurred by the interpreter's bf16 truncation (the kernels' own
    tests cover the half types)."""
    from minfer.layers import linear
    from minfer.layers.norm import RMSNorm
    from minfer.models.llama import LlamaMLP

    torch.manual_seed(3)
    cfg = type("Cfg", (), {"hidden_size": 96, "intermediate_size": 160})
    mlp, norm = LlamaMLP(cfg, linear.SINGLE).to(device), RMSNorm(96, 1e-6).to(device)
    for p in mlp.parameters():
        p.data.normal_(std=p.shape[1] ** -0.5)  # activations of order one
    norm.weight.data.normal_(1.0, 0.2)
    x, residual = torch.randn((1, 96), device=device), torch.randn((1, 96), device=device)
    unfused = mlp.forward_normed(norm, x, residual), mlp.gate_up_proj.forward_normed(norm, x)
    monkeypatch.setattr(linear, "_folds_prologue", lambda x, w, silu: gemv.suits(x.numel() // x.shape[-1], w))
    fused = mlp.forward_normed(norm, x, residual), mlp.gate_up_proj.forward_normed(norm, x)
    assert fused[1][1] is x  # without a residual the stream is x itself
    for (out, stream), (expected, expected_stream) in zip(fused, unfused):
        torch.testing.assert_close(stream, expected_stream, atol=0, rtol=0)
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("epilogue", ["on", "off"])
def test_the_mlp_on_the_kernels_returns_what_torch_returns(monkeypatch, device, rows, epilogue):
    """LlamaMLP routed as on a GPU (every product to minfer's Triton kernels, the interpreter off
    one) with the SiLU as gate_up's epilogue, and without (the down's prologue or its own
    launch), against the torch path; with the norm folded, with it apart, and without it."""
    from minfer.layers import linear
    from minfer.layers.norm import RMSNorm
    from minfer.models.llama import LlamaMLP

    torch.manual_seed(4)
    cfg = type("Cfg", (), {"hidden_size": 96, "intermediate_size": 160})
    mlp, norm = LlamaMLP(cfg, linear.SINGLE).to(device), RMSNorm(96, 1e-6).to(device)
    for p in mlp.parameters():
        p.data.normal_(std=p.shape[1] ** -0.5)
    norm.weight.data.normal_(1.0, 0.2)
    x, residual = torch.randn((rows, 96), device=device), torch.randn((rows, 96), device=device)
    expected = mlp.forward_normed(norm, x, residual), mlp(x)
    monkeypatch.setattr(linear, "on_triton", lambda x: True)
    monkeypatch.setattr(linear, "_GEMV_EPILOGUE", epilogue)
    assert mlp.gate_up_proj.folds_silu(x) is (epilogue == "on")
    for prologue in ("auto", "off"):
        monkeypatch.setattr(linear, "_GEMV_PROLOGUE", prologue)
        got = mlp.forward_normed(norm, x, residual), mlp(x)
        torch.testing.assert_close(got[0][1], expected[0][1], atol=0, rtol=0)
        torch.testing.assert_close(got[0][0], expected[0][0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got[1], expected[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "rows, n, k, silu, pays",
    [  # the H200 measurements behind gemv's bounds (docs/BENCHMARKS.md, nineteenth session)
        (1, 28672, 4096, False, True),  # Llama-3.1-8B's gate_up norm at one row: paid
        (2, 4096, 2048, False, True),  # Qwen3-1.7B's qkv norm at two rows: paid
        (2, 12288, 2048, False, False),  # its gate_up norm at two rows: lost
        (1, 1024, 3072, True, True),  # Qwen3-0.6B's SiLU before down: paid with the norms
        (1, 2048, 6144, True, False),  # Qwen3-1.7B's: lost
        (1, 4096, 14336, True, False),  # Llama-3.1-8B's: lost
        (4, 4096, 1024, False, False),  # not a gemv product at all
    ],
)
def test_prologues_fold_where_they_were_measured_to_pay(rows, n, k, silu, pays):
    """gemv.prologue_pays: a norm always at one row, otherwise the grid's re-read of its input
    rows against the prologue's bound (weights on the meta device: only shape and dtype matter;
    the meta device counts 4 SMs, which leaves these grids as they are on an H200)."""
    weight = torch.empty((n, k), dtype=torch.bfloat16, device="meta")
    assert gemv.prologue_pays(rows, weight, silu) is pays
