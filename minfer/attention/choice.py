"""Which attention backend a run gets, and which KV pool layout that backend reads best."""

from __future__ import annotations

import torch


def make_attention_backend(name: str, device: torch.device, low_bit: bool = False):
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from minfer.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from minfer.attention.torch_backend import TorchAttentionBackend
    from minfer.attention.torch_fast import FastTorchAttentionBackend

    # A --quantization model (low_bit) takes the faster prefill; the default float32 one stays bit-identical.
    return FastTorchAttentionBackend() if low_bit else TorchAttentionBackend()


def wants_head_major_pool(backend, device: torch.device) -> bool:
    """The CPU torch backends read each head's keys fastest as one contiguous matrix (KVPool's
    doc); the Triton kernels, and CUDA's fused rope_store, index slot-major rows."""
    return device.type == "cpu" and backend.name != "triton"
