"""The KV pool: one K and one V tensor per layer, indexed by physical slot."""

from __future__ import annotations

import torch

# --kv-cache-dtype: "auto" stores K/V in the compute dtype; "fp8_e4m3" (vLLM's and SGLang's name)
# stores float8_e4m3fn, one byte per value, with a float32 scale per layer and kv head.
KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn}
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448: e4m3fn has no infinity, so store() clamps


def kv_storage_dtype(kv_cache_dtype: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The element type the pool holds for a --kv-cache-dtype value."""
    return KV_CACHE_DTYPES.get(kv_cache_dtype, compute_dtype)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, Hk, D] / scale [Hk] -> float8_e4m3fn, saturating at +-448 (the cast alone gives NaN)."""
    return (x.float() / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of quantize_fp8, in `dtype` (what the Triton kernels compute in registers);
    `scale` shaped to broadcast over x's head axis."""
    return (x.float() * scale).to(dtype)


class KVPool:
    """Per-layer K/V tensors of shape [num_slots + page_size, num_kv_heads, head_dim], views of
    one `storage` tensor, and the same memory seen head first (`heads(layer)`: [num_kv_heads,
    num_slots + page_size, head_dim]).

    Two layouts of `storage`, one meaning: slot-major [layer, k|v, slot, kv head, dim], which the
    Triton kernels index (a slot's heads one contiguous row), and head-major [layer, k|v, kv head,
    slot, dim], which the CPU torch backend asks for (`head_major`): there each head's keys of a
    request are one contiguous matrix, and a decode step's q.k and p.v run about twice as fast
    as over the slot-major rows (docs/BENCHMARKS.md, CPU decode attention at long contexts).
    `k`/`v` and every method below mean the same in both; only `storage` differs.

    The last page (slots num_slots .. num_slots + page_size - 1) is never handed out: padded
    rows of a CUDA-graph batch write their K/V there, so they cannot corrupt a real request.

    With an fp8 cache, `k_scale` / `v_scale` ([num_layers, num_kv_heads] float32) are static:
    a slot holds value / scale, and a scale that changed later would silently re-scale every
    entry written before it (cached prefixes included). They are 1.0 unless set_scales() is
    called before the first store (vLLM's default without calibrated scales is also 1.0);
    docs/MEMORY.md records what calibrated scales changed on the default model.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_dtype: str = "auto",
        head_major: bool = False,
    ):
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scratch_slot = num_slots
        self.dtype = dtype  # what gather_heads() returns and attention computes in
        self.storage_dtype = kv_storage_dtype(kv_cache_dtype, dtype)
        self.quantized = self.storage_dtype != dtype
        self.head_major = head_major
        # One allocation, each layer's K and V a contiguous block of it: the host tier moves a
        # page of every layer with ONE gather or scatter kernel over this tensor
        # (minfer/kvcache/host_tier.py) instead of one per layer and K/V.
        slots = num_slots + page_size
        per_layer = (num_kv_heads, slots, head_dim) if head_major else (slots, num_kv_heads, head_dim)
        self.storage = torch.zeros((num_layers, 2, *per_layer), dtype=self.storage_dtype, device=device)
        # [slot, kv head, dim] in both layouts (a strided view of a head-major pool).
        self.k = [self._slot_first(self.storage[i, 0]) for i in range(num_layers)]
        self.v = [self._slot_first(self.storage[i, 1]) for i in range(num_layers)]
        self.k_scale = torch.ones((num_layers, num_kv_heads), dtype=torch.float32, device=device)
        self.v_scale = torch.ones((num_layers, num_kv_heads), dtype=torch.float32, device=device)
        # What the Triton kernels take for each layer (views: set_scales updates them in place),
        # built once rather than per layer per step; empty for a pool in the compute dtype.
        self.kernel_scales = [
            {"k_scale": self.k_scale[i], "v_scale": self.v_scale[i]} if self.quantized else {}
            for i in range(num_layers)
        ]

    def _slot_first(self, block: torch.Tensor) -> torch.Tensor:
        return block.transpose(0, 1) if self.head_major else block

    def heads(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s K and V head first, [kv head, slot, dim]: views, contiguous per head
        in a head-major pool. (Taken from `k`/`v` on each call, so they follow those lists.)"""
        return self.k[layer].transpose(0, 1), self.v[layer].transpose(0, 1)

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
    ) -> int:
        itemsize = torch.empty((), dtype=kv_storage_dtype(kv_cache_dtype, dtype)).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * itemsize

    def set_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Static per-(layer, kv head) scales; only before anything is stored (see the class doc)."""
        self.k_scale.copy_(k_scale)
        self.v_scale.copy_(v_scale)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor) -> None:
        """Write step of the KV life cycle: new K/V of this pass go to their allocated slots.
        (On CUDA the model writes through the fused minfer/kernels/rope_store.py instead.)"""
        if self.quantized:  # CPU torch has no index_copy_ for float8: copy the bytes
            k = quantize_fp8(k, self.k_scale[layer]).view(torch.uint8)
            v = quantize_fp8(v, self.v_scale[layer]).view(torch.uint8)
            self.k[layer].view(torch.uint8).index_copy_(0, out_loc, k)
            self.v[layer].view(torch.uint8).index_copy_(0, out_loc, v)
            return
        self.k[layer].index_copy_(0, out_loc, k)
        self.v[layer].index_copy_(0, out_loc, v)

    def gather_heads(
        self, layer: int, slots: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Read step for the torch backends: K and V at `slots` ([S] int64) head first, each
        [Hk, S, D] and contiguous, in the dtype attention computes with (copied into `out`, two
        [Hk, S, D] tensors of the storage dtype, where given). Every torch-side read of the pool
        goes through here, so a change of storage format (a low-bit cache) has one place to decode."""
        # index_select, not k[:, slots]: advanced indexing on CPU goes through a parallel kernel
        # whose thread wake-up costs milliseconds on a busy machine.
        k_out, v_out = out or (None, None)
        k_heads, v_heads = self.heads(layer)
        k = torch.index_select(k_heads, 1, slots, out=k_out)
        v = torch.index_select(v_heads, 1, slots, out=v_out)
        if self.quantized:  # an fp8 pool's bytes times their head's scale
            k = dequantize_fp8(k, self.k_scale[layer][:, None, None], self.dtype)
            v = dequantize_fp8(v, self.v_scale[layer][:, None, None], self.dtype)
        return k, v
