"""Mixture-of-experts MLP: a router picks `top_k` of `num_experts` gated MLPs per token.

Expert weights are stacked, one tensor for all experts, in the layout transformers 5.x keeps
in memory (and may save): `gate_up_proj` is (experts, 2 x intermediate, hidden) with the gate
rows first, `down_proj` is (experts, hidden, intermediate). Checkpoints that store one matrix
per expert (`experts.3.gate_proj.weight`, Mixtral's `w1`/`w3`/`w2`) are stacked as they load.

Tensor parallelism shards each expert's intermediate dimension across ranks, as the dense MLP
does: each rank holds every expert's slice of the gate/up rows and of the down columns, and
one all-reduce sums the partial outputs. Expert parallelism (each rank a subset of whole
experts) would change only which experts a rank holds and how outputs are combined; routing
stays replicated.

On CUDA the experts run as grouped GEMMs (minfer.kernels.moe); elsewhere `moe_reference`, a
loop over the experts that received tokens, which is also the kernels' test oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minfer.distributed.parallel import SINGLE, TPGroup
from minfer.layers.linear import _divide, linear


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [tokens, top_k], expert ids int64 [tokens, top_k]): softmax over all
    experts in float32, the top k, renormalised to sum to 1 when the model says so
    (Mixtral always; Qwen3-MoE by `norm_topk_prob`). On CUDA one fused kernel does it all
    (minfer/kernels/moe_router.py), checked against this torch path."""
    if router_logits.is_cuda:
        from minfer.kernels.moe_router import route_top_k

        return route_top_k(router_logits, top_k, renormalize)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_reference(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The experts' weighted sum per token, one expert at a time (only experts with tokens)."""
    out = torch.zeros_like(x)
    # weights in x's dtype, as transformers applies them, so that float32 models match it exactly
    topk_weights = topk_weights.to(x.dtype)
    for expert in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == expert)
        gate, up = F.linear(x[token], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert]) * topk_weights[token, slot, None]
        out.index_add_(0, token, y)
    return out


class Router(nn.Module):
    """The replicated [experts, hidden] gate matrix (every rank routes alike)."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # minfer's linear: at decode sizes on CUDA the split-K GEMM (cuBLAS took 5 us for this
        # 0.5 MB matrix at batch 1 on an H200)
        return linear(x, self.weight)

    def select(self, x: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """select_experts of this router's logits; at decode sizes on CUDA the GEMM and the
        selection are one launch (minfer/kernels/moe_router.py)."""
        if x.is_cuda:
            from minfer.kernels.moe_router import FUSED_MAX_TOKENS, route_top_k_fused

            if x.shape[0] <= FUSED_MAX_TOKENS:
                return route_top_k_fused(x, self.weight, top_k, renormalize)
        return select_experts(self(x), top_k, renormalize)


class FusedExperts(nn.Module):
    """All experts of one layer, stacked; this rank's share of each expert's intermediate dim."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.num_experts = num_experts
        self.inter_per_rank = _divide(intermediate, tp.size, "moe intermediate size")
        n = self.inter_per_rank
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * n, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, n), requires_grad=False)
        self.gate_up_proj.weight_loader = self._load
        self.down_proj.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int | None, str]) -> None:
        """shard = (expert, part): part is gate / up / down for one expert's matrix; with
        expert None, a tensor that stacks every expert's gate_up, gate, up or down."""
        expert, part = shard
        n, start = self.inter_per_rank, self.tp.rank * self.inter_per_rank
        full = self.gate_up_proj.shape[1] // 2 * self.tp.size  # the unsharded intermediate size
        if expert is None and part == "gate_up":
            param.data[:, :n].copy_(loaded.narrow(1, start, n))
            param.data[:, n:].copy_(loaded.narrow(1, full + start, n))
        elif expert is None and part == "down":
            param.data.copy_(loaded.narrow(2, start, n))
        elif expert is None:
            offset = 0 if part == "gate" else n
            param.data[:, offset : offset + n].copy_(loaded.narrow(1, start, n))
        elif part == "down":
            param.data[expert].copy_(loaded.narrow(1, start, n))
        else:
            offset = 0 if part == "gate" else n
            param.data[expert, offset : offset + n].copy_(loaded.narrow(0, start, n))

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, reduce: bool = True
    ) -> torch.Tensor:
        """The partial (this rank's) weighted sum of each token's experts; with reduce=False on
        CUDA, its terms [tokens, top_k, hidden] (see SparseMoeBlock)."""
        if x.is_cuda:
            from minfer.kernels.moe import fused_moe

            return fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, reduce=reduce)
        return moe_reference(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)


class SparseMoeBlock(nn.Module):
    """Router, experts, and the one all-reduce of the partial sums under TP."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        tp: TPGroup = SINGLE,
    ):
        super().__init__()
        self.tp, self.top_k, self.renormalize = tp, top_k, renormalize
        self.gate = Router(hidden, num_experts)
        self.experts = FusedExperts(num_experts, hidden, intermediate, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The experts' sum per token [tokens, hidden]; on one CUDA device its terms [tokens,
        top_k, hidden] instead: the decoder layer's output always goes to the next RMSNorm's
        residual add (models/llama.py), whose kernel sums them (kernels/norm.py) and so
        saves the reduction's launch (4.9 us per layer at batch-1 decode on an H200)."""
        weights, ids = self.gate.select(x, self.top_k, self.renormalize)
        if x.is_cuda and self.tp.size == 1:
            return self.experts(x, weights, ids, reduce=False)
        return self.tp.all_reduce(self.experts(x, weights, ids))


def expert_weight_bytes(model: nn.Module) -> int:
    """Bytes of this rank's expert weights (the memory line and the bench floor count them)."""
    return sum(
        p.numel() * p.element_size()
        for m in model.modules()
        if isinstance(m, FusedExperts)
        for p in (m.gate_up_proj, m.down_proj)
    )
