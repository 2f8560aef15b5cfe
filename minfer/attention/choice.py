"""Which attention backend a run gets, and which KV pool layout that backend reads best."""

from __future__ import annotations

import torch


def make_attention_backend(name: str, device: torch.device, low_bit: bool = False):
    """The backend `--attention-backend` names. "torch": plain matmuls, transformers' eager
    attention bit for bit (the float32 default's reference). "sdpa": the same backend with its
    prefill through torch's scaled_dot_product_attention, transformers' sdpa attention bit for
    bit, its attention 2-2.5x faster on long CPU prompts (torch_fast.py). "auto": triton on
    CUDA; on the CPU "torch", or "sdpa" for a --quantization model (`low_bit`), whose numerics
    differ from transformers' by far more than the two attentions' rounding."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else ("sdpa" if low_bit else "torch")
    if name == "triton":
        from minfer.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "sdpa":
        from minfer.attention.torch_fast import FastTorchAttentionBackend

        return FastTorchAttentionBackend()
    from minfer.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


def wants_head_major_pool(backend, device: torch.device) -> bool:
    """The CPU torch backends read each head's keys fastest as one contiguous matrix (KVPool's
    doc); the Triton kernels, and CUDA's fused rope_store, index slot-major rows."""
    return device.type == "cpu" and backend.name != "triton"
