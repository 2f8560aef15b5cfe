"""Qwen3: the Llama decoder with per-head RMSNorm on queries and keys (no Q/K/V bias)."""

from minfer.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
