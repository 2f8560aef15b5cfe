"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head Q/K RMSNorm) with
sparse MLPs of `num_experts` experts, `num_experts_per_tok` per token and no shared expert.
A layer is dense (`intermediate_size`) when listed in `mlp_only_layers` or when
`(layer + 1) % decoder_sparse_step != 0`, as transformers decides it."""

from minfer.models.moe import MoeForCausalLM


class Qwen3MoeForCausalLM(MoeForCausalLM):
    qk_norm = True

    def is_sparse_layer(self, cfg, layer_id: int) -> bool:
        only_dense = getattr(cfg, "mlp_only_layers", None) or []
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        return layer_id not in only_dense and cfg.num_experts > 0 and (layer_id + 1) % step == 0

    def renormalize(self, cfg) -> bool:
        return bool(getattr(cfg, "norm_topk_prob", False))

    def moe_intermediate_size(self, cfg) -> int:
        return cfg.moe_intermediate_size

    def num_experts(self, cfg) -> int:
        return cfg.num_experts
