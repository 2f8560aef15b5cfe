"""Mixtral (8x7B, 8x22B): the Mistral decoder whose every MLP is `num_local_experts` experts of
`intermediate_size`, top-`num_experts_per_tok` (2) per token, weights renormalised to sum to 1.

As for Mistral, a `sliding_window` is applied by the attention layer (the released Mixtral
configs set `sliding_window: null`).
"""

from minfer.models.moe import MoeForCausalLM


class MixtralForCausalLM(MoeForCausalLM):
    def num_experts(self, cfg) -> int:
        return cfg.num_local_experts
