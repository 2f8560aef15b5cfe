"""The fused MoE kernels (minfer.kernels.moe) against the torch reference path
(minfer.layers.moe.moe_reference), on CPU through Triton's interpreter at tiny shapes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from minfer.kernels import moe  # noqa: E402
from minfer.layers.moe import moe_reference, select_experts  # noqa: E402

TINY = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1}


def _layer(tokens, hidden, inter, experts, top_k, dtype, device, seed=0, only_experts=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    logits = torch.randn(tokens, experts, generator=gen)
    if only_experts is not None:  # the others receive no token
        blocked = torch.ones(experts, dtype=torch.bool)
        blocked[only_experts] = False
        logits[:, blocked] = -1e9
    weights, ids = select_experts(logits, top_k, renormalize=True)
    to = dict(dtype=dtype, device=device)
    return x.to(**to), gate_up.to(**to), down.to(**to), weights.to(device), ids.to(device)


@pytest.mark.parametrize("use_kernel", [False, True])
def test_align_groups_rows_by_expert_in_padded_blocks(use_kernel, device):
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], device=device)  # expert 1 gets nothing
    rows, block_expert, total = moe.align_to_experts(ids, 4, 4, use_kernel)
    n = ids.numel()
    assert int(total) == 12  # experts 0, 2, 3: one block of 4 each
    assert rows[:12].tolist() == [1, 4, n, n, 0, 2, 5, n, 3, n, n, n]
    assert block_expert[:3].tolist() == [0, 2, 3]
    assert sorted(r for r in rows[:12].tolist() if r < n) == list(range(n))


@pytest.mark.parametrize("tokens,experts,top_k,block_m", [(1, 128, 8, 16), (37, 6, 3, 16), (40, 32, 4, 16)])
def test_align_kernel_matches_torch_ops(tokens, experts, top_k, block_m, device):
    """40 x 4 rows over 32 experts: several chunks per scan."""
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1).indices.to(device)
    want_rows, want_experts, want_total = moe.align_to_experts_torch(ids, experts, block_m)
    rows, block_expert, total = moe.align_to_experts(ids, experts, block_m, use_kernel=True)
    end = int(want_total)
    assert int(total) == end
    assert torch.equal(rows[:end], want_rows[:end])
    assert torch.equal(block_expert[: end // block_m], want_experts[: end // block_m])


@pytest.mark.parametrize(
    "tokens,hidden,inter,experts,top_k,only",
    [
        (1, 32, 16, 8, 2, None),  # decode of one token: 6 experts idle
        (5, 48, 40, 8, 2, None),  # ragged N and K tiles
        (37, 32, 24, 4, 2, None),  # several blocks per expert
        (9, 32, 16, 6, 3, [1, 4, 5]),  # half the experts receive no token
    ],
)
def test_fused_moe_matches_reference(device, tokens, hidden, inter, experts, top_k, only):
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    x, gate_up, down, weights, ids = _layer(
        tokens, hidden, inter, experts, top_k, dtype, device, only_experts=only
    )
    got = moe.fused_moe(x, gate_up, down, weights, ids, TINY)
    expected = moe_reference(x.float(), gate_up.float(), down.float(), weights, ids)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.float(), expected, **tol)


def test_block_configs_cover_decode_and_prefill():
    decode, prefill = moe.config_for(64 * 8, 128), moe.config_for(4096 * 8, 128)
    assert decode["BLOCK_M"] < prefill["BLOCK_M"]
    for config in (decode, prefill):
        assert set(config) == set(TINY)


def test_few_rows_skip_the_align_step():
    """Batch-1 decode of Qwen3-30B-A3B (8 of 128 experts) and of Mixtral (2 of 8): one row per
    block, no align launch; a batch whose rows outnumber a quarter of the experts: aligned."""
    assert moe.config_for(8, 128).get("one_row_blocks") and moe.config_for(2, 8).get("one_row_blocks")
    assert not moe.config_for(64 * 8, 128).get("one_row_blocks") and not moe.config_for(4, 8).get(
        "one_row_blocks"
    )


@pytest.mark.parametrize(
    "tokens,hidden,inter,experts,top_k",
    [
        (1, 32, 16, 8, 2),  # Mixtral-like decode of one token
        (1, 48, 40, 16, 8),  # ragged N and K tiles, eight experts per token
        (3, 40, 24, 4, 3),  # tokens sharing experts (weights read once per row)
    ],
)
def test_one_row_blocks_match_reference(device, tokens, hidden, inter, experts, top_k):
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    x, gate_up, down, weights, ids = _layer(tokens, hidden, inter, experts, top_k, dtype, device, seed=3)
    got = moe.fused_moe(x, gate_up, down, weights, ids, dict(TINY, one_row_blocks=True))
    expected = moe_reference(x.float(), gate_up.float(), down.float(), weights, ids)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.float(), expected, **tol)


def test_float32_configs_fit_shared_memory():
    """Three fp32 tiles per stage (x, gate, up): the table's stages would overflow an H200's
    227 KiB of shared memory, so float32 runs with at most two."""
    for rows in (8, 64 * 8, 4096 * 8):  # one row per block, decode, prefill
        config = moe.config_for(rows, 128, element_size=4)
        tile = config["BLOCK_K"] * (config["BLOCK_M"] + 2 * config["BLOCK_N"]) * 4
        assert config["num_stages"] * tile <= 227 * 1024
