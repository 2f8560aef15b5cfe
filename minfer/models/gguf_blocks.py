"""The raw quantized blocks of a GGUF file's matrices, for kernels that run them as they are.

`gguf.py` dequantizes every tensor to float32; this reads Q4_0, Q4_1 and Q8_0 tensors' blocks
instead (GGML's layouts, 32 weights per block along a row):
  Q4_0  fp16 d, 16 bytes of nibbles          w = d * (q - 8)
  Q4_1  fp16 d, fp16 m, 16 bytes of nibbles  w = d * q + m
  Q8_0  fp16 d, 32 int8                      w = d * q
Byte j of the nibbles holds weight j in its low half and weight j + 16 in its high half.
Rows keep the same Q/K un-permutation as the float path (whole rows move, blocks stay intact).
The embedding and the LM head are not read (they stay float). Parsing the file costs seconds
(GGUFReader reads every vocabulary string: 2-16 s for the default model on a busy 2-core
machine), so the blocks are cached next to gguf.py's float32 copy, as safetensors (codes one
byte per weight: 103 MiB for the default model), and read from there in ~0.1 s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from minfer.models.gguf import (
    PERMUTED_QK,
    _architecture,
    _field,
    _hf_name,
    unpermute_qk,
)
from minfer.models.gguf_cache import cache_dir, publish

CACHE_ENTRY = "blocks-v1"  # bump the suffix when the layout below changes
_PARTS = ("codes", "scales", "mins")

BLOCK = 32


@dataclass
class GGUFBlocks:
    """One matrix as blocks: weight[r, 32 b + i] = scales[r, b] * codes[r, 32 b + i] + mins[r, b]."""

    kind: str  # Q4_0 | Q4_1 | Q8_0
    codes: torch.Tensor  # [out, in] uint8 (4-bit kinds: 0..15) or int8 (Q8_0)
    scales: torch.Tensor  # [out, in / 32] float32
    mins: torch.Tensor  # [out, in / 32] float32 (zero for Q8_0)


def _split_blocks(data: np.ndarray, rows: int, block_bytes: int) -> np.ndarray:
    return np.ascontiguousarray(data).reshape(rows, -1, block_bytes)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[rows, blocks, 16] bytes -> [rows, blocks * 32] codes in 0..15."""
    codes = np.concatenate((packed & 0x0F, packed >> 4), axis=-1)
    return codes.reshape(packed.shape[0], -1)


def read_blocks(tensor) -> GGUFBlocks | None:
    """The tensor's blocks, or None for a type this module does not read (F32, F16, K-quants)."""
    kind = tensor.tensor_type.name
    rows = int(tensor.shape[1]) if len(tensor.shape) == 2 else 0
    if kind not in ("Q4_0", "Q4_1", "Q8_0") or rows == 0:
        return None
    data = np.asarray(tensor.data, dtype=np.uint8)
    if kind == "Q4_1":
        blocks = _split_blocks(data, rows, 20)
        scales = blocks[..., 0:2].copy().view(np.float16)[..., 0]
        mins = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        codes = _nibbles(blocks[..., 4:])
    elif kind == "Q4_0":
        blocks = _split_blocks(data, rows, 18)
        scales = blocks[..., 0:2].copy().view(np.float16)[..., 0]
        mins = -8 * scales.astype(np.float32)
        codes = _nibbles(blocks[..., 2:])
    else:
        blocks = _split_blocks(data, rows, 34)
        scales = blocks[..., 0:2].copy().view(np.float16)[..., 0]
        mins = np.zeros(scales.shape, np.float32)
        codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
    return GGUFBlocks(
        kind,
        torch.from_numpy(np.ascontiguousarray(codes)),
        torch.from_numpy(scales.astype(np.float32)),
        torch.from_numpy(np.asarray(mins, np.float32)),
    )


def gguf_blocks(path: str) -> dict[str, GGUFBlocks]:
    """Hugging Face name -> blocks, for every layer matrix of the file stored as Q4_0, Q4_1 or Q8_0."""
    cached = cache_dir(path) / CACHE_ENTRY / "blocks.safetensors"
    if cached.exists():
        return _read_cache(cached)
    found = _read_file(path)
    publish(cache_dir(path), CACHE_ENTRY, partial(_write_cache, found))
    return found


def _read_file(path: str) -> dict[str, GGUFBlocks]:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = _architecture(reader)
    num_heads = _field(reader, f"{arch}.attention.head_count")
    heads = {"q_proj": num_heads, "k_proj": _field(reader, f"{arch}.attention.head_count_kv", num_heads)}
    found = {}
    for tensor in reader.tensors:
        if not tensor.name.startswith("blk.") or not tensor.name.endswith(".weight"):
            continue
        blocks = read_blocks(tensor)
        if blocks is None:
            continue
        name = _hf_name(tensor.name)
        proj = name.split(".")[-2]
        if arch in PERMUTED_QK and proj in heads:
            blocks = GGUFBlocks(
                blocks.kind,
                *(unpermute_qk(t, heads[proj]) for t in (blocks.codes, blocks.scales, blocks.mins)),
            )
        found[name] = blocks
    return found


def _write_cache(found: dict[str, GGUFBlocks], directory: Path) -> None:
    from safetensors.torch import save_file

    tensors = {f"{name}.{part}": getattr(b, part) for name, b in found.items() for part in _PARTS}
    kinds = json.dumps({name: b.kind for name, b in found.items()})
    save_file(tensors, str(directory / "blocks.safetensors"), metadata={"kinds": kinds})


def _read_cache(file: Path) -> dict[str, GGUFBlocks]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        kinds = json.loads(f.metadata()["kinds"])
        return {
            name: GGUFBlocks(kind, *(f.get_tensor(f"{name}.{part}") for part in _PARTS))
            for name, kind in kinds.items()
        }
