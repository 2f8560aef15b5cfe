"""`--quantization`: give a loaded model's linear layers low-bit weights for CPU decode.

  none  float weights as loaded (a .gguf file dequantized to float32): the default
  gguf   the .gguf file's own Q4_0 / Q4_1 blocks, exactly (Q8_0 matrices: int8 per channel)
  int4   any checkpoint: asymmetric 4-bit blocks of 32 computed at load (as Q4_1 does)
  int8   any checkpoint: symmetric int8, one scale per output channel
Each layer also keeps a dense matrix of the weights its low-bit form stands for, for prefill
and large decode batches: bfloat16 where the CPU multiplies it natively, else float32 (see
minfer/layers/quantized_linear.py). The embedding stays float32; the LM head gets int4 and
bfloat16 copies of it whose top logits are recomputed from it (minfer/layers/quantized_head.py).
MINFER_LOW_BIT_HEAD=float32 keeps the float32 head, for A/B measurements.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from minfer.config import QUANTIZATION_METHODS, ConfigError
from minfer.layers.linear import ColumnParallelLinear, RowParallelLinear
from minfer.layers.quantized_head import HEAD_LOW_BIT_MAX_ROWS, LowBitHead
from minfer.layers.quantized_linear import (
    BF16_DENSE_MAX_ROWS,
    LowBitWeight,
    dense_dtype,
    dequantize_int4,
    int4_from_blocks,
    prepack,
    quantize_int4,
    quantize_int8,
)
from minfer.models.quantized_forward import install_lean_forward

log = logging.getLogger(__name__)

# a fused parameter's checkpoint matrices, in the order its rows hold them
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def check_quantization(method: str | None, load_format: str, device_type: str, tp_size: int) -> str:
    """The method to apply, or a ConfigError naming what does not fit."""
    method = method or "none"
    if method == "none":
        return method
    if method not in QUANTIZATION_METHODS:
        raise ConfigError(f"--quantization {method} is not one of {list(QUANTIZATION_METHODS)}")
    if device_type != "cpu":
        raise ConfigError(f"--quantization {method} runs on CPU only (its kernels are torch's CPU ones)")
    if tp_size > 1:
        raise ConfigError(f"--quantization {method} needs --tp 1")
    if method == "gguf" and load_format != "gguf":
        raise ConfigError("--quantization gguf needs a .gguf model; use int4 or int8 for other checkpoints")
    return method


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (n, m) for n, m in model.named_modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)
    ]


def quantize_model(model: nn.Module, method: str, gguf_path: str | None = None) -> None:
    """Give every linear layer of `model` a low-bit weight (see the module docstring)."""
    if method == "none":
        return
    model.quantized = True  # the engine gives such a model the faster torch attention path
    blocks = None
    if method == "gguf":
        from minfer.models.gguf_blocks import gguf_blocks

        blocks = gguf_blocks(gguf_path)
    float_bytes = low_bit_bytes = 0
    kept_float = []
    for name, layer in linear_layers(model):
        weight = layer.weight.data
        if blocks is None:
            low_bit = _from_float(weight, method)
        else:
            low_bit = _from_gguf(name, weight, blocks)
            if low_bit is None:
                kept_float.append(name)
                continue
        layer.low_bit = low_bit
        float_bytes += weight.numel() * weight.element_size()
        low_bit_bytes += low_bit.nbytes
        if dense_dtype() != weight.dtype:  # instead of, not beside, the float32 matrix
            layer.weight.data = weight.to(dense_dtype())
            low_bit.max_rows = BF16_DENSE_MAX_ROWS
            low_bit.dense_packed = prepack(layer.weight.data)
    head = getattr(model, "lm_head", None)
    if head is not None and os.environ.get("MINFER_LOW_BIT_HEAD") != "float32":
        head.low_bit = _low_bit_head(head.weight.data)
    decoder = getattr(model, "model", None)
    if decoder is not None:
        install_lean_forward(decoder)
    log.info(
        "--quantization %s: %d linear layers read %.0f MiB per decode step instead of %.0f MiB of float%s",
        method,
        len(linear_layers(model)) - len(kept_float),
        low_bit_bytes / 2**20,
        float_bytes / 2**20,
        f"; kept float (not Q4_0/Q4_1/Q8_0 in the file): {kept_float}" if kept_float else "",
    )


def _low_bit_head(weight: torch.Tensor) -> LowBitHead:
    # 4-bit blocks of 32 computed from the float32 matrix (a GGUF token_embd is Q8_0, whose
    # per-32 int8 blocks no kernel takes); the float32 refinement of the top logits covers the
    # difference where it matters.
    low_bit = int4_from_blocks(*quantize_int4(weight))
    low_bit.max_rows = HEAD_LOW_BIT_MAX_ROWS
    dense = weight.to(dense_dtype())
    low_bit.dense_packed = prepack(dense)
    return LowBitHead(low_bit, dense, weight)


def _from_float(weight: torch.Tensor, method: str) -> LowBitWeight:
    if method == "int8":
        low_bit, dequantized = quantize_int8(weight)
    else:
        codes, scales, mins = quantize_int4(weight)
        low_bit, dequantized = int4_from_blocks(codes, scales, mins), dequantize_int4(codes, scales, mins)
    weight.copy_(dequantized)
    return low_bit


def _from_gguf(name: str, weight: torch.Tensor, blocks: dict) -> LowBitWeight | None:
    prefix, _, own = name.rpartition(".")
    parts = [blocks.get(f"{prefix}.{part}.weight") for part in FUSED_PARTS.get(own, (own,))]
    if any(p is None for p in parts) or len({p.kind for p in parts}) != 1:
        return None
    if parts[0].kind == "Q8_0":  # per-32 int8 blocks have no kernel: per-channel int8 of the same weights
        low_bit, dequantized = quantize_int8(weight)
        weight.copy_(dequantized)
        return low_bit
    # The float matrix already holds these blocks dequantized (the default load path), so
    # prefill stays bit-identical to --quantization none.
    return int4_from_blocks(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scales", "mins")))


def decode_weight_bytes(model: nn.Module, float_bytes: int) -> int:
    """Bytes of weights one decode step reads: `float_bytes` (all parameters) with each low-bit
    layer's float matrix replaced by its packed form (the float copy serves prefill only)."""
    for _, layer in linear_layers(model):
        if layer.low_bit is not None:
            weight = layer.weight
            float_bytes += layer.low_bit.nbytes - weight.numel() * weight.element_size()
    head = getattr(model, "lm_head", None)
    if head is not None and head.low_bit is not None:
        # The float32 head matrix is then read for REFINE_TOP rows a token only (tied: the
        # embedding, whose one row a token is read either way).
        float_bytes += head.low_bit.nbytes - head.weight.numel() * head.weight.element_size()
    return float_bytes
