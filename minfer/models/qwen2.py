"""Qwen2 / Qwen2.5: the Llama decoder with biased Q/K/V projections."""

from minfer.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
