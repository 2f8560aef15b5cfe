"""Mistral: architecturally the Llama decoder.

Mistral-7B-v0.1's sliding window (4096) is not applied: minfer attends over the full
context, which is exact for sequences up to the window and for later Mistral releases,
whose configs set `sliding_window: null`.
"""

from minfer.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
