"""Rotary position embedding (RoPE), with the llama3, linear and YaRN frequency scalings.

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
    if kind == "yarn":
        return _yarn_frequencies(inv_freq, head_dim, theta, params)
    raise ValueError(f"unsupported rope type {kind!r} (supported: default, linear, llama3, yarn)")


def _yarn_frequencies(inv_freq: torch.Tensor, head_dim: int, theta: float, params: dict) -> torch.Tensor:
    """YaRN (Qwen2.5's and Qwen3's long-context setting): dimensions that turn fewer than
    beta_slow times over the pretraining context are interpolated (divided by `factor`), those
    that turn more than beta_fast times keep their frequency, and a linear ramp over dimension
    indices blends the two in between; transformers' formula step by step."""
    factor = float(params["factor"])
    old_len = float(params["original_max_position_embeddings"])
    beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)

    def dimension_of(rotations: float) -> float:  # the dimension that turns `rotations` times over old_len
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_of(beta_fast), dimension_of(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency, 0: interpolated
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def attention_factor(params: dict) -> float:
    """YaRN scales cos and sin (so every q . k) by this: 0.1 ln(factor) + 1 by default, or the
    config's attention_factor, or the mscale / mscale_all_dim ratio; 1 for other RoPE types."""
    if params["rope_type"] != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = float(params["factor"])

    def mscale(scale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):
        return float(mscale(params["mscale"]) / mscale(params["mscale_all_dim"]))
    return mscale(1.0)


def context_length(hf_config) -> int:
    """Positions the model can take: max_position_embeddings, or with YaRN its pretraining
    context times the factor when that is longer (vLLM's rule: Qwen2.5's config keeps 32,768
    while YaRN x4 serves 131,072)."""
    length = int(hf_config.max_position_embeddings)
    params = rope_parameters(hf_config)
    if params["rope_type"] == "yarn":
        length = max(length, int(float(params["original_max_position_embeddings"]) * float(params["factor"])))
    return length


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, params: dict):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, params)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        scale = attention_factor(params)
        if scale != 1.0:  # folded into the table, so the CPU path and rope_store both apply it
            cos_sin = cos_sin * scale
        self.register_buffer("cos_sin", cos_sin, persistent=False)

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
