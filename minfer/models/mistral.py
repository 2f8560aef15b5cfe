"""Mistral: architecturally the Llama decoder.

Mistral-7B-v0.1's sliding window (4096; later releases set `sliding_window: null`) is applied
by the attention layer: layers/attention.py `sliding_window_of` reads it from the config.
"""

from minfer.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
