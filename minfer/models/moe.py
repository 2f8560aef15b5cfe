"""The Llama decoder with mixture-of-experts MLPs (Qwen3-MoE, Mixtral), and how per-expert
checkpoint tensors find their slice of the stacked expert parameters (layers/moe.py)."""

from __future__ import annotations

import re

from minfer.distributed.parallel import TPGroup
from minfer.layers.moe import SparseMoeBlock
from minfer.models.llama import LlamaForCausalLM

# `...mlp.experts.7.gate_proj.weight` (Qwen3-MoE) / `...mlp.experts.7.w1.weight` (Mixtral)
_PER_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
# All experts in one tensor: transformers 5.x's own form (`...mlp.experts.gate_up_proj`), or
# GGUF's, which stacks gate and up apart (`...mlp.experts.gate_proj.weight`, models/gguf_moe.py).
_STACKED = re.compile(r"\.mlp\.experts\.(gate_up_proj|gate_proj|up_proj|down_proj)(\.weight)?$")


class MoeForCausalLM(LlamaForCausalLM):
    """Subclasses say which layers are sparse and how the router's top-k is renormalised."""

    def is_sparse_layer(self, cfg, layer_id: int) -> bool:
        return True

    def renormalize(self, cfg) -> bool:
        return True

    def moe_intermediate_size(self, cfg) -> int:
        return cfg.intermediate_size

    def num_experts(self, cfg) -> int:
        raise NotImplementedError

    def make_mlp(self, cfg, layer_id: int, tp: TPGroup):
        if not self.is_sparse_layer(cfg, layer_id):
            return None  # the dense LlamaMLP of `intermediate_size`
        return SparseMoeBlock(
            cfg.hidden_size,
            self.moe_intermediate_size(cfg),
            self.num_experts(cfg),
            cfg.num_experts_per_tok,
            self.renormalize(cfg),
            tp,
        )

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's checkpoint name for the MLP
        per_expert = _PER_EXPERT.search(name)
        if per_expert:
            expert, part = per_expert.groups()
            target = name[: per_expert.start()] + ".mlp.experts."
            target += "down_proj" if _PART[part] == "down" else "gate_up_proj"
            return target, (int(expert), _PART[part])
        stacked = _STACKED.search(name)
        if stacked:
            part = stacked.group(1).removesuffix("_proj")
            target = name[: stacked.start()] + ".mlp.experts."
            return target + ("down_proj" if part == "down" else "gate_up_proj"), (None, part)
        return super().checkpoint_target(name)
