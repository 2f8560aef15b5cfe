"""Mixture-of-experts GGUF files: what models/gguf.py adds for them.

llama.cpp stores a layer's experts stacked, one tensor per projection: `blk.N.ffn_gate_exps`
[experts, intermediate, hidden] (torch order), `ffn_up_exps` likewise, `ffn_down_exps`
[experts, hidden, intermediate], and the router as `ffn_gate_inp` [experts, hidden]. They map
to stacked names that models/moe.py loads as whole (`mlp.experts.gate_proj.weight`, ...).
Qwen3-MoE files say `qwen3moe`; Mixtral files say `llama` and carry `llama.expert_count`.
Every layer of such a file is sparse (llama.cpp has no `mlp_only_layers`), and Qwen3-MoE's
top-k weights are renormalised (llama.cpp does so for every Qwen3-MoE).
"""

from __future__ import annotations

MOE_ARCHITECTURES = {"qwen3moe": "Qwen3MoeForCausalLM"}
MOE_MODEL_TYPES = {"Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral"}
MOE_LAYER_NAMES = {  # blk.N.<key> -> model.layers.N.<value>
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}


def moe_architecture(architecture: str, meta) -> tuple[str, dict]:
    """(Hugging Face architecture, its expert config fields) for a file read as `architecture`;
    `meta(key)` reads `<gguf arch>.<key>`. A dense file comes back unchanged, with no fields."""
    experts = meta("expert_count")
    if not experts:
        return architecture, {}
    used = meta("expert_used_count")
    if architecture == "LlamaForCausalLM":
        return "MixtralForCausalLM", {"num_local_experts": experts, "num_experts_per_tok": used}
    if architecture == "Qwen3MoeForCausalLM":
        return architecture, {
            "num_experts": experts,
            "num_experts_per_tok": used,
            "moe_intermediate_size": meta("expert_feed_forward_length"),
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    raise ValueError(f"GGUF file of {architecture} with {experts} experts is not supported")
