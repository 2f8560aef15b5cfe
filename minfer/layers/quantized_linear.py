"""Low-bit weights for CPU decode: torch's weight-only int4 / int8 matmul kernels.

A decode step reads every weight once per token, so on a CPU its time is the bytes of the
weights over the memory bandwidth: SmolLM2-135M's linear layers are 425 MB as float32 and
53 MB as 4-bit codes. The kernels are `aten._weight_int4pack_mm_for_cpu` (group-wise scale
and zero point: w = (q - 8) * scale + zero, which holds GGUF Q4_0 and Q4_1 blocks exactly)
and `aten._weight_int8pack_mm` (one scale per output channel).

Measured on a 2-core AVX512 CPU, one thread, a 1536x576 matrix (us per call):
  rows            1     4     16    64
  float32 F.linear 130   243   343   686
  int4, bf16 x    43    79    313   1216
  int4, f32 x     1298  (the float32 path of the kernel is a slow reference loop)
So the kernels take bfloat16 activations (their output is cast back to the model's float32),
and only for a few rows: past `max_rows` (prefill, large decode batches) the kernel's cost
grows with the rows while a dense GEMM's barely does, so the layer also keeps a dense matrix
of the same weights (the dequantized blocks) for those. On a CPU that multiplies bfloat16
natively (AMX or AVX512-BF16: `dense_dtype`) that matrix is bfloat16 instead of float32: half
the memory and, through oneDNN, 4-6x faster (one thread, us per call):
  rows x matrix      13 x 1536x576  64 x 3072x576  256 x 3072x576
  float32 F.linear   618            1623           5075
  bfloat16 F.linear  142            439            880
and the low-bit kernel then pays only up to BF16_DENSE_MAX_ROWS rows (int4 vs bf16 at 6 rows,
3072x576: 298 vs 274 us). Without those instructions the dense matrix stays float32.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

GROUP_SIZE = 32  # GGUF's Q4_0 / Q4_1 / Q8_0 block length
LOW_BIT_MAX_ROWS = 12  # rows up to which the low-bit kernel beats float32 (crossover ~14 in the table above)
BF16_DENSE_MAX_ROWS = 5  # ... and bfloat16 (crossover 5-6 rows on every SmolLM2 matrix)
KERNEL_DTYPE = torch.bfloat16
_INNER_K_TILES = 2  # the packing layout's K tiling; the kernel accepts 2, 4 or 8 (all ran alike)
# The ops themselves, looked up once: torch.ops' attribute chain costs ~1 us a call.
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default
_INT8_MM = torch.ops.aten._weight_int8pack_mm.default
_PACKED_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None)  # absent without oneDNN
PREPACK_ROWS_HINT = 16  # the row count oneDNN's layout is chosen for (any count runs)
PREPACKED_MAX_ROWS = 512  # past ~1,000 rows F.linear's own layout is as fast (`prepack`)


@dataclass
class LowBitWeight:
    """One linear layer's weights in a kernel's packed form ([out, in] logically)."""

    kind: str  # int4 | int8
    packed: torch.Tensor  # int4: the kernel's packed uint8; int8: [out, in] int8
    scales: torch.Tensor  # int4: [in / GROUP_SIZE, out, 2] (scale, zero); int8: [out]
    out_features: int
    max_rows: int = LOW_BIT_MAX_ROWS
    dense_packed: torch.Tensor | None = None  # the bf16 dense matrix in oneDNN's layout: `prepack`

    def matmul(self, x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """x @ W^T in x's dtype; `dense` is W in float, used when x has more than `max_rows` rows."""
        return self.product(x, dense).to(x.dtype)

    def input_dtype(self, rows: int, dense: torch.Tensor) -> torch.dtype:
        """The dtype `product` multiplies an x of `rows` rows in: a producer of x that writes it
        so saves the cast."""
        return dense.dtype if rows > self.max_rows else self.scales.dtype

    def product(self, x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """x @ W^T in the dtype it is computed in (the kernel's, or `dense`'s), uncast: a caller
        whose next op promotes it (a float32 add) saves a cast."""
        if x.dim() != 2:
            flat = self.product(x.reshape(-1, x.shape[-1]), dense)
            return flat.view(*x.shape[:-1], self.out_features)
        if x.shape[0] > self.max_rows:  # `.to` is a no-op for a float32 `dense`
            if self.dense_packed is not None and x.shape[0] <= PREPACKED_MAX_ROWS:
                return _PACKED_LINEAR(x.to(dense.dtype), self.dense_packed, None, "none", [], "")
            return F.linear(x.to(dense.dtype), dense)
        x = x.to(self.scales.dtype)
        if self.kind == "int4":
            return _INT4_MM(x, self.packed, GROUP_SIZE, self.scales)
        return _INT8_MM(x, self.packed, self.scales)

    @property
    def nbytes(self) -> int:
        return (
            self.packed.numel() * self.packed.element_size()
            + self.scales.numel() * self.scales.element_size()
        )


@functools.cache
def cpu_multiplies_bf16() -> bool:
    """Whether this CPU has native bfloat16 products (AMX or AVX-512 BF16), which both the bf16
    dense matrix and oneDNN's bf16 layout (`prepack`) need."""
    probes = [
        getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    ]
    return any(probe is not None and probe() for probe in probes)


@functools.cache
def dense_dtype() -> torch.dtype:
    """The dtype of a low-bit layer's dense matrix: bfloat16 where the CPU multiplies it natively
    (MINFER_LOW_BIT_DENSE=float32 forces float32, for A/B measurements)."""
    if os.environ.get("MINFER_LOW_BIT_DENSE") == "float32":
        return torch.float32
    return torch.bfloat16 if cpu_multiplies_bf16() else torch.float32


def prepack(dense: torch.Tensor) -> torch.Tensor | None:
    """`dense` (bfloat16 [out, in]) in oneDNN's blocked layout, or None where that does not
    apply. F.linear re-lays the weight out on every call; pre-laid out, the same products
    (bit-identical) took 23 vs 33 ms over SmolLM2-135M's 120 matrices at 16 rows, 46 vs 66 at
    256, 76 vs 99 at 512, and no less from ~1,000 rows (one thread, AMX). It is a second copy
    of the dense matrix (+203 MB on that model, +56 MB for its head's). None on a CPU without
    native bf16 products, where the dense matrix is float32 anyway (`dense_dtype`).
    MINFER_LOW_BIT_PREPACK=0 keeps F.linear, for A/B measurements."""
    if (
        dense.dtype != torch.bfloat16
        or os.environ.get("MINFER_LOW_BIT_PREPACK") == "0"
        or _PACKED_LINEAR is None
        or not torch.backends.mkldnn.is_available()
        # without native bf16 oneDNN refuses the layout ("bf16 path needs the cpu support ...")
        or not cpu_multiplies_bf16()
    ):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(dense, PREPACK_ROWS_HINT)


def int4_from_blocks(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, dtype: torch.dtype = KERNEL_DTYPE
) -> LowBitWeight:
    """Blocks of GROUP_SIZE codes q in [0, 15] along the input dim, each block's weights
    scale * q + min (GGUF Q4_1; Q4_0 is min = -8 * scale). codes [out, in]; scales, mins
    [out, in / GROUP_SIZE]."""
    out_features, in_features = codes.shape
    if in_features % GROUP_SIZE or scales.shape != (out_features, in_features // GROUP_SIZE):
        raise ValueError(f"int4 blocks of {GROUP_SIZE} do not tile a [{out_features}, {in_features}] matrix")
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), _INNER_K_TILES)
    zeros = mins + 8 * scales  # the kernel computes (q - 8) * scale + zero
    scale_and_zeros = torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous().to(dtype)
    return LowBitWeight("int4", packed, scale_and_zeros, out_features)


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The float32 [out, in] matrix the blocks stand for."""
    out_features, in_features = codes.shape
    grouped = codes.view(out_features, -1, GROUP_SIZE).float()
    return torch.addcmul(mins.unsqueeze(-1).float(), grouped, scales.unsqueeze(-1).float()).view(
        out_features, in_features
    )


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit blocks of GROUP_SIZE (as GGUF's Q4_1 does): each block's min maps to
    code 0, its max to 15. Returns (codes, scales, mins) for `int4_from_blocks`."""
    out_features, in_features = weight.shape
    grouped = weight.float().view(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scales = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    codes = ((grouped - low.unsqueeze(-1)) / scales.unsqueeze(-1)).round_().clamp_(0, 15)
    return codes.to(torch.uint8).view(out_features, in_features), scales, low


def quantize_int8(
    weight: torch.Tensor, dtype: torch.dtype = KERNEL_DTYPE
) -> tuple[LowBitWeight, torch.Tensor]:
    """Symmetric int8 with one scale per output channel; also returns the float32 matrix the
    codes stand for (with the scale rounded to the kernel's dtype, as the kernel applies it)."""
    scales = (weight.float().abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    scales = scales.to(dtype).float()
    codes = (weight.float() / scales.unsqueeze(1)).round_().clamp_(-127, 127).to(torch.int8)
    low_bit = LowBitWeight("int8", codes, scales.to(dtype), weight.shape[0])
    return low_bit, codes.float() * scales.unsqueeze(1)
