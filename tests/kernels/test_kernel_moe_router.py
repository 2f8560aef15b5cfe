"""The fused router selection (softmax, top k, renormalise) picks what the torch path picks."""

from __future__ import annotations

import pytest
import torch

from minfer.kernels.moe_router import route_top_k, route_top_k_fused
from minfer.layers.moe import select_experts


@pytest.mark.parametrize(
    "tokens,experts,top_k,renormalize",
    [
        (1, 128, 8, True),
        (7, 128, 8, False),
        (5, 8, 2, True),
        (3, 60, 4, True),
        (2, 256, 8, False),
        (0, 8, 2, True),
    ],
)
def test_route_top_k_matches_select_experts(device, tokens, experts, top_k, renormalize):
    torch.manual_seed(tokens * 1000 + experts)
    logits = torch.randn(tokens, experts) * 2
    want_w, want_i = select_experts(logits, top_k, renormalize)  # CPU: the torch path
    got_w, got_i = route_top_k(logits.to(device), top_k, renormalize)
    assert got_i.dtype == torch.int64 and got_w.dtype == torch.float32
    assert torch.equal(got_i.cpu(), want_i)
    torch.testing.assert_close(got_w.cpu(), want_w, rtol=1e-6, atol=1e-7)


def test_route_top_k_reads_bf16_logits(device):
    """Router logits come out of a bf16 GEMM on the GPU: the kernel widens them itself. bf16
    logits tie often; torch.topk orders tied experts as it likes (the kernel: lowest index
    first), so the rows are compared as sets of (expert, weight)."""
    torch.manual_seed(3)
    logits = (torch.randn(4, 128) * 2).to(torch.bfloat16)
    want_w, want_i = select_experts(logits.float(), 8, True)
    got_w, got_i = route_top_k(logits.to(device), 8, True)
    assert torch.equal(got_i.cpu().sort(dim=-1).values, want_i.sort(dim=-1).values)
    order = got_i.cpu().argsort(dim=-1)
    torch.testing.assert_close(
        got_w.cpu().gather(1, order), want_w.gather(1, want_i.argsort(dim=-1)), rtol=1e-6, atol=1e-7
    )


@pytest.mark.parametrize("tokens,hidden,experts,top_k", [(1, 64, 128, 8), (5, 40, 8, 2), (3, 600, 60, 4)])
def test_fused_router_matches_gemm_then_select(device, tokens, hidden, experts, top_k):
    """The router GEMM joined to the selection (the last program of a token selects): the
    experts and weights of select_experts(x @ W.T); twice, so the arrival counters must have
    been reset by the first launch. hidden 600: the K loop's ragged last block."""
    torch.manual_seed(tokens + hidden)
    x = torch.randn(tokens, hidden)
    weight = torch.randn(experts, hidden) / hidden**0.5
    want_w, want_i = select_experts(x @ weight.T, top_k, True)
    for _ in range(2):
        got_w, got_i = route_top_k_fused(x.to(device), weight.to(device), top_k, True)
        assert torch.equal(got_i.cpu(), want_i)
        torch.testing.assert_close(got_w.cpu(), want_w, rtol=1e-5, atol=1e-6)
