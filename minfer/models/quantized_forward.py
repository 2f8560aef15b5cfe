"""The Llama decoder's forward under --quantization on CPU: the same math in fewer torch ops.

A batch-1 decode step of SmolLM2-135M on one thread spent ~9.5 ms of its ~20 ms in the int4
kernels; most of the rest was per-op cost (~1.5-3 us per torch op and ~1-2 us per nn.Module
call, ~60 ops in each of 30 layers): the module path converts every kernel output back to
float32 before its consumer, rotates q and k with ~16 small ops, and adds the residual into a
new tensor. `LeanDecoderForward` runs the same layers as plain function calls:
- kernel outputs stay in the kernel's dtype (bfloat16) where the consumer promotes them for
  free (the residual add, the MLP product): bf16 -> float32 is exact, so the values are those
  of a cast first;
- RoPE as x * cos + halves_swapped(x) * signed_sin on q and k at once, with the two tables
  gathered once per pass rather than per layer (26 -> 4 us per layer);
- the residual stream is added in place, and RMSNorm is torch's `F.rms_norm` (one call,
  bit-identical to `RMSNorm`'s float32 formula on this CPU);
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
from minfer.layers.linear import ColumnParallelLinear, RowParallelLinear
from minfer.layers.norm import RMSNorm


def install_lean_forward(decoder: nn.Module) -> bool:
    """Give `decoder` (a LlamaModel) a LeanDecoderForward if it fits; returns whether it did."""
    if os.environ.get("MINFER_QUANTIZED_FORWARD") == "modules" or not LeanDecoderForward.fits(decoder):
        return False
    decoder.lean_forward = LeanDecoderForward(decoder)
    return True


def _project(layer: ColumnParallelLinear | RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
    """layer(x), in the dtype the product came in (bfloat16 from the kernels and bf16 dense
    matrices): the caller casts only where its consumer does not promote."""
    if layer.low_bit is None:
        return layer(x)
    y = layer.low_bit.product(x, layer.weight)
    return y if layer.bias is None else y + layer.bias


def _input_dtype(layer: ColumnParallelLinear | RowParallelLinear, rows: int) -> torch.dtype:
    """The dtype `_project(layer, x)` multiplies x in (bfloat16 for the kernels)."""
    if layer.low_bit is None:
        return layer.weight.dtype
    return layer.low_bit.input_dtype(rows, layer.weight)


def _rms_norm(x: torch.Tensor, norm: RMSNorm, dtype: torch.dtype) -> torch.Tensor:
    """norm(x) written in `dtype`, its consumer's input dtype: rounded once, no separate cast.
    Five small ops where F.rms_norm ran seven and two scalar copies (12 vs 16 us in situ,
    after an int4 matmul); the sum of squares in another order than `RMSNorm`'s mean (4.8e-7)."""
    inv_rms = torch.linalg.vecdot(x, x).unsqueeze_(-1).div_(x.shape[-1]).add_(norm.eps).rsqrt_()
    return torch.mul(
        torch.mul(x, inv_rms), norm.weight, out=torch.empty(x.shape, dtype=dtype, device=x.device)
    )


class LeanDecoderForward:
    """LlamaModel.forward for one-rank CPU models with low-bit layers (see the module docstring)."""

    def __init__(self, decoder: nn.Module):
        self.decoder = decoder
        attn = decoder.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        half = self.head_dim // 2
        cos, sin = attn.rotary.cos_sin.split(half, dim=-1)  # [positions, D / 2] each
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
        decoder = self.decoder
        residual = decoder.embed_tokens(input_ids)  # a new tensor: safe to add into in place
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D], shared by every layer of the pass
        sin = self.signed_sin[positions].unsqueeze(1)
        layers, rows = decoder.layers, residual.shape[0]
        hidden = _rms_norm(
            residual, layers[0].input_layernorm, _input_dtype(layers[0].self_attn.qkv_proj, rows)
        )
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            residual.add_(_project(attn.o_proj, self._attention(attn, hidden, cos, sin, ctx)))
            gate_up = getattr(layer.mlp, "gate_up_proj", None)  # None: a module MLP (experts)
            mlp_dtype = residual.dtype if gate_up is None else _input_dtype(gate_up, rows)
            hidden = _rms_norm(residual, layer.post_attention_layernorm, mlp_dtype)
            residual.add_(self._mlp(layer.mlp, hidden, rows))
            if i + 1 < len(layers):
                following = layers[i + 1]
                qkv_dtype = _input_dtype(following.self_attn.qkv_proj, rows)
                hidden = _rms_norm(residual, following.input_layernorm, qkv_dtype)
        return _rms_norm(residual, decoder.norm, residual.dtype)

    def _attention(
        self, attn: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        rows = hidden.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = _project(attn.qkv_proj, hidden).float()
        rotary_heads = heads + kv_heads
        qk = qkv[:, : rotary_heads * head_dim].view(rows, rotary_heads, head_dim)  # q and k heads
        v = qkv[:, rotary_heads * head_dim :].view(rows, kv_heads, head_dim)
        if attn.q_norm is not None:  # Qwen3: each head normalised before RoPE
            qk = torch.cat([attn.q_norm(qk[:, :heads]), attn.k_norm(qk[:, heads:])], dim=1)
        swapped = qk.view(rows, rotary_heads, 2, head_dim // 2).flip(2).view(rows, rotary_heads, head_dim)
        rotated = torch.addcmul(qk * cos, swapped, sin)
        ctx.kv_pool.store(attn.layer_id, rotated[:, heads:], v, ctx.out_loc)
        out = ctx.backend.forward(rotated[:, :heads], attn.layer_id, ctx, attn.attn.scale)
        return out.reshape(rows, heads * head_dim)

    @staticmethod
    def _mlp(mlp: nn.Module, hidden: torch.Tensor, rows: int) -> torch.Tensor:
        gate_up = getattr(mlp, "gate_up_proj", None)
        if gate_up is None:
            return mlp(hidden)
        gate, up = _project(gate_up, hidden).chunk(2, dim=-1)
        # silu(gate) * up computed in float32 and rounded once into the down projection's dtype
        down_dtype = _input_dtype(mlp.down_proj, rows)
        product = torch.empty(gate.shape, dtype=down_dtype, device=gate.device)
        return _project(mlp.down_proj, torch.mul(F.silu(gate.float()), up, out=product))
