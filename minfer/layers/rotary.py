"""Rotary position embedding (RoPE), with the llama3 and linear frequency scalings.

The cos/sin table is computed once for every position up to the context length; a forward
pass gathers the rows of its positions. Rotation follows the "rotate half" convention of
Hugging Face checkpoints (llama.cpp's interleaved layout is undone when GGUF files load).
"""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_parameters(hf_config) -> dict:
    """RoPE settings from either config form: transformers 5's `rope_parameters`, or the
    older `rope_theta` + `rope_scaling` most checkpoints on disk still carry."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        params = dict(params)
    else:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def inverse_frequencies(head_dim: int, params: dict) -> torch.Tensor:
    theta = float(params["rope_theta"])
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled)
    raise ValueError(f"unsupported rope type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, params: dict):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, params)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hk, D]; returns both rotated (new tensors). On CUDA the model
        uses minfer/kernels/rope_store.py instead, which rounds exactly as this does."""
        cos, sin = self.cos_sin[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
        cos = torch.cat([cos, cos], dim=-1)
        sin = torch.cat([sin, sin], dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
