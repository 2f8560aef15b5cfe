"""The Llama decoder's forward under --quantization on CPU: the same math in fewer torch ops.

A batch-1 decode step of SmolLM2-135M on one thread spent ~9.5 ms of its ~20 ms in the int4
kernels; most of the rest was per-op and per-call cost (~2-4 us per small torch op right after
an int4 matmul, ~1-2 us per nn.Module call, ~0.5 us per parameter or submodule attribute read;
~60 ops in each of 30 layers): the module path casts every kernel output back to float32
before its consumer, rotates q and k with ~16 small ops, and adds the residual into a new
tensor. `LeanDecoderForward` runs the same layers as plain calls over references gathered once
(`_Layer`, `_Linear`: no nn.Module attribute lookups per step):
- kernel outputs stay in the kernel's dtype (bfloat16) where the consumer promotes them (the
  residual add, the MLP product): bf16 -> float32 is exact, so the values are a cast's;
- the norms and the MLP product write their consumer's input dtype, rounded once;
- RoPE as x * cos + halves_swapped(x) * signed_sin on q and k at once, the two tables gathered
  once per pass rather than per layer (26 -> 4 us per layer);
- the residual stream is added in place.
It is installed only by `quantize_model` (the default float32 model keeps the module path, so
its log-likelihoods stay bit-identical) and only for decoders it knows; MINFER_QUANTIZED_FORWARD
=modules keeps the module path, for A/B measurements (scripts/cpu_quant_ab.py).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from minfer.attention.base import ForwardContext
from minfer.layers.norm import RMSNorm


def install_lean_forward(decoder: nn.Module) -> bool:
    """Give `decoder` (a LlamaModel) a LeanDecoderForward if it fits; returns whether it did."""
    if os.environ.get("MINFER_QUANTIZED_FORWARD") == "modules" or not LeanDecoderForward.fits(decoder):
        return False
    decoder.lean_forward = LeanDecoderForward(decoder)
    return True


class _Linear:
    """One linear layer's tensors, read once (see `install_lean_forward`'s caller: after
    quantize_model has set them)."""

    __slots__ = ("module", "low_bit", "weight", "bias")

    def __init__(self, module: nn.Module):
        self.module, self.low_bit, self.weight, self.bias = module, module.low_bit, module.weight, module.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """module(x), in the dtype the product came in (bfloat16 from the kernels)."""
        if self.low_bit is None:
            return self.module(x)
        y = self.low_bit.product(x, self.weight)
        return y if self.bias is None else y + self.bias

    def input_dtype(self, rows: int) -> torch.dtype:
        """The dtype x is multiplied in: a producer that writes it so saves the cast."""
        return self.weight.dtype if self.low_bit is None else self.low_bit.input_dtype(rows, self.weight)


class _Norm:
    __slots__ = ("weight", "eps")

    def __init__(self, norm: RMSNorm):
        self.weight, self.eps = norm.weight, norm.eps

    def __call__(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """RMSNorm(x) written in `dtype`, its consumer's input dtype: rounded once, no separate
        cast. Five small ops where F.rms_norm ran seven and two scalar copies (batch-1 step
        18.5 -> 18.1 ms); the sum of squares in another order than RMSNorm's mean (4.8e-7)."""
        inv_rms = torch.linalg.vecdot(x, x).unsqueeze_(-1).div_(x.shape[-1]).add_(self.eps).rsqrt_()
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
        return torch.mul(torch.mul(x, inv_rms), self.weight, out=out)


class _Layer:
    """A decoder layer's parts as plain references."""

    def __init__(self, layer: nn.Module):
        attn = layer.self_attn
        self.layer_id, self.scale, self.window = attn.layer_id, attn.attn.scale, attn.attn.sliding_window
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm  # Qwen3's per-head norms, or None
        self.qkv, self.o = _Linear(attn.qkv_proj), _Linear(attn.o_proj)
        self.input_norm = _Norm(layer.input_layernorm)
        self.post_norm = _Norm(layer.post_attention_layernorm)
        gate_up = getattr(layer.mlp, "gate_up_proj", None)
        self.mlp = layer.mlp  # run as a module when not the gated MLP (mixture of experts)
        self.gate_up = None if gate_up is None else _Linear(gate_up)
        self.down = None if gate_up is None else _Linear(layer.mlp.down_proj)


class LeanDecoderForward:
    """LlamaModel.forward for one-rank CPU models with low-bit layers (see the module docstring)."""

    def __init__(self, decoder: nn.Module):
        self.embed = decoder.embed_tokens
        self.layers = [_Layer(layer) for layer in decoder.layers]
        self.final_norm = _Norm(decoder.norm)
        attn = decoder.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        cos, sin = attn.rotary.cos_sin.split(self.head_dim // 2, dim=-1)  # [positions, D / 2] each
        # rotate_half(x) * sin == swap_halves(x) * [-sin, sin]: one flip, no negation per layer
        self.cos = torch.cat([cos, cos], dim=-1)
        self.signed_sin = torch.cat([-sin, sin], dim=-1)

    @staticmethod
    def fits(decoder: nn.Module) -> bool:
        """A one-rank decoder whose layers are the Llama attention block (any MLP)."""
        layers = getattr(decoder, "layers", None)
        if not layers:
            return False
        attn = getattr(layers[0], "self_attn", None)
        return (
            attn is not None
            and attn.qkv_proj.tp.size == 1
            and attn.head_dim % 2 == 0
            and hasattr(attn, "rotary")
            and hasattr(attn.rotary, "cos_sin")
        )

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        residual = self.embed(input_ids)  # a new tensor: safe to add into in place
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D], shared by every layer of the pass
        sin = self.signed_sin[positions].unsqueeze(1)
        layers, rows = self.layers, residual.shape[0]
        hidden = layers[0].input_norm(residual, layers[0].qkv.input_dtype(rows))
        for i, layer in enumerate(layers):
            residual.add_(layer.o(self._attention(layer, hidden, cos, sin, ctx)))
            if layer.gate_up is None:
                residual.add_(layer.mlp(layer.post_norm(residual, residual.dtype)))
            else:
                hidden = layer.post_norm(residual, layer.gate_up.input_dtype(rows))
                gate, up = layer.gate_up(hidden).chunk(2, dim=-1)
                # silu(gate) * up in float32, rounded once into the down projection's dtype
                product = torch.empty(gate.shape, dtype=layer.down.input_dtype(rows), device=gate.device)
                residual.add_(layer.down(torch.mul(F.silu(gate.float()), up, out=product)))
            if i + 1 < len(layers):
                following = layers[i + 1]
                hidden = following.input_norm(residual, following.qkv.input_dtype(rows))
        return self.final_norm(residual, residual.dtype)

    def _attention(
        self, layer: _Layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        rows = hidden.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = layer.qkv(hidden).float()
        rotary_heads = heads + kv_heads
        qk = qkv[:, : rotary_heads * head_dim].view(rows, rotary_heads, head_dim)  # q and k heads
        v = qkv[:, rotary_heads * head_dim :].view(rows, kv_heads, head_dim)
        if layer.q_norm is not None:  # Qwen3: each head normalised before RoPE
            qk = torch.cat([layer.q_norm(qk[:, :heads]), layer.k_norm(qk[:, heads:])], dim=1)
        swapped = qk.view(rows, rotary_heads, 2, head_dim // 2).flip(2).view(rows, rotary_heads, head_dim)
        rotated = torch.addcmul(qk * cos, swapped, sin)
        ctx.kv_pool.store(layer.layer_id, rotated[:, heads:], v, ctx.out_loc)
        out = ctx.backend.forward(rotated[:, :heads], layer.layer_id, ctx, layer.scale, window=layer.window)
        return out.reshape(rows, heads * head_dim)
