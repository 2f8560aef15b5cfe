"""The MoE router's selection in one launch: softmax over the experts, the top k, renormalise.

In torch this is five to seven kernels per layer (softmax, a top-k that sorts, a sum, a divide,
casts). Profiled on an H200 at batch 1 (Qwen3-30B-A3B, 48 MoE layers), they took ~19 us per
layer, 0.9 ms of a 4.0 ms decode step: more than the attention. One program per token holds
its row of router logits (num_experts <= a few hundred) in registers and picks the k best by
repeated argmax, so the whole selection is one small kernel.

At decode sizes the router's GEMM joins it (`route_top_k_fused`): programs (token, block of
experts) compute their logits as matrix-vector products and store them, and the last program
of a token to arrive (an atomic counter per token) runs the selection on the whole row. That
is one launch for the router instead of two (at batch 1 on an H200: a 3.8 us split-K GEMM and
a 2.2 us selection per layer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minfer.kernels.common import arrival_counters


@triton.jit
def _select(
    x,
    offs,
    mask,
    weights_ptr,
    ids_ptr,
    row,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """Softmax of one row of logits x [BLOCK_E] (float32, -inf past the experts), its TOP_K
    best (lowest index on ties), renormalised if asked; stores weights and ids of `row`."""
    e = tl.exp(x - tl.max(x, 0))
    probs = e / tl.sum(e, 0)
    probs = tl.where(mask, probs, -1.0)  # padding lanes are never picked
    slots = tl.arange(0, BLOCK_K)
    picked_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    picked_i = tl.zeros([BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, 0)
        best_i = tl.min(tl.where(probs == best, offs, BLOCK_E), 0)
        picked_w = tl.where(slots == j, best, picked_w)
        picked_i = tl.where(slots == j, best_i.to(tl.int64), picked_i)
        probs = tl.where(offs == best_i, -1.0, probs)
    if RENORMALIZE:
        picked_w = picked_w / tl.sum(tl.where(slots < TOP_K, picked_w, 0.0), 0)
    out = slots < TOP_K
    tl.store(weights_ptr + row * TOP_K + slots, picked_w, mask=out)
    tl.store(ids_ptr + row * TOP_K + slots, picked_i, mask=out)


@triton.jit
def _route_top_k_kernel(
    logits_ptr,
    stride_row,
    weights_ptr,
    ids_ptr,
    num_experts,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < num_experts
    x = tl.load(logits_ptr + row * stride_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
    _select(x, offs, mask, weights_ptr, ids_ptr, row, TOP_K, BLOCK_K, BLOCK_E, RENORMALIZE)


@triton.jit
def _router_fused_kernel(
    x_ptr,
    w_ptr,
    logits_ptr,
    counter_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    hidden,
    stride_x,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EXPERTS_PER_PROGRAM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """Program (token, j): logits of experts [j * EXPERTS_PER_PROGRAM, ...) rounded to x's dtype
    (as the unfused GEMM's output is), stored; the token's last program selects."""
    row = tl.program_id(0).to(tl.int64)
    offs_e = tl.program_id(1) * EXPERTS_PER_PROGRAM + tl.arange(0, EXPERTS_PER_PROGRAM)
    e_mask = offs_e < num_experts
    offs_h = tl.arange(0, BLOCK_H)
    acc = tl.zeros((EXPERTS_PER_PROGRAM, BLOCK_H), dtype=tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        h = h0 + offs_h
        h_mask = h < hidden
        x = tl.load(x_ptr + row * stride_x + h, mask=h_mask, other=0.0).to(tl.float32)
        w = tl.load(
            w_ptr + offs_e[:, None].to(tl.int64) * hidden + h[None, :],
            mask=e_mask[:, None] & h_mask[None, :],
            other=0.0,
        )
        acc += w.to(tl.float32) * x[None, :]
    logits = tl.sum(acc, axis=1).to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * num_experts + offs_e, logits, mask=e_mask)
    tl.debug_barrier()  # every thread's store precedes the arrival (release) that publishes it
    arrived = tl.atomic_add(counter_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(1) - 1:
        offs = tl.arange(0, BLOCK_E)
        mask = offs < num_experts
        row_logits = tl.load(
            logits_ptr + row * num_experts + offs, mask=mask, other=float("-inf"), cache_modifier=".cg"
        )
        _select(
            row_logits.to(tl.float32),
            offs,
            mask,
            weights_ptr,
            ids_ptr,
            row,
            TOP_K,
            BLOCK_K,
            BLOCK_E,
            RENORMALIZE,
        )
        tl.atomic_xchg(counter_ptr + row, 0, sem="relaxed", scope="gpu")


FUSED_MAX_TOKENS = 256  # decode sizes; beyond, the GEMM and the selection launch apart
_EXPERTS_PER_PROGRAM = 2  # many programs of a short dot each: the GEMV is latency-bound at batch 1


def route_top_k_fused(
    x: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """route_top_k(x @ router_weight.T, ...) in one launch, for at most FUSED_MAX_TOKENS
    tokens; x [tokens, hidden] and router_weight [experts, hidden] contiguous in the last dim."""
    tokens, hidden = x.shape
    num_experts = router_weight.shape[0]
    assert tokens <= FUSED_MAX_TOKENS and x.stride(-1) == 1 and router_weight.is_contiguous()
    assert top_k <= num_experts
    logits = torch.empty((tokens, num_experts), dtype=x.dtype, device=x.device)
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=x.device)
    if tokens:
        _router_fused_kernel[(tokens, triton.cdiv(num_experts, _EXPERTS_PER_PROGRAM))](
            x,
            router_weight,
            logits,
            arrival_counters(x.device, "router", FUSED_MAX_TOKENS),  # one per token
            weights,
            ids,
            num_experts,
            hidden,
            x.stride(0),
            TOP_K=top_k,
            BLOCK_K=triton.next_power_of_2(top_k),
            EXPERTS_PER_PROGRAM=_EXPERTS_PER_PROGRAM,
            BLOCK_H=min(2048, triton.next_power_of_2(hidden)),
            BLOCK_E=triton.next_power_of_2(num_experts),
            RENORMALIZE=renormalize,
            num_warps=4,
        )
    return weights, ids


def route_top_k(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `minfer.layers.moe.select_experts` returns (weights float32, ids int64, both
    [tokens, top_k], best first), from logits [tokens, experts] whose last dim is contiguous."""
    tokens, num_experts = router_logits.shape
    assert router_logits.stride(-1) == 1 and top_k <= num_experts
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=router_logits.device)
    if tokens:
        _route_top_k_kernel[(tokens,)](
            router_logits,
            router_logits.stride(0),
            weights,
            ids,
            num_experts,
            TOP_K=top_k,
            BLOCK_K=triton.next_power_of_2(top_k),
            BLOCK_E=triton.next_power_of_2(num_experts),
            RENORMALIZE=renormalize,
            num_warps=1 if num_experts <= 128 else 4,
        )
    return weights, ids
