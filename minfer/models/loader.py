"""Read a model's config, build it, and fill its weights (where a model comes from:
minfer/models/source.py)."""

from __future__ import annotations

import glob
import json
import logging
import math
import os
from collections.abc import Iterator

import torch

from minfer.distributed.parallel import SINGLE, TPGroup
from minfer.models.registry import model_class_for
from minfer.models.source import (  # noqa: F401 (re-exported: callers find a model through the loader)
    DEFAULT_MODEL_FILE,
    SHIPPED_CONFIGS,
    ModelSource,
    default_model_path,
    model_source,
    read_chat_template,
    resolve_model,
)
from minfer.models.tokenizer_files import load_tokenizer  # noqa: F401 (re-exported, as below)

log = logging.getLogger(__name__)


def load_hf_config(source: ModelSource):
    if source.path.endswith(".gguf"):
        from minfer.models.gguf import gguf_config

        return gguf_config(source.path)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source.path)
    except (ValueError, KeyError) as e:  # e.g. an unknown model_type
        with open(os.path.join(source.path, "config.json")) as f:
            raw = json.load(f)
        raise ValueError(
            f"cannot read config of {source.path!r} (model_type={raw.get('model_type')!r}, "
            f"architectures={raw.get('architectures')}): {e}"
        ) from e


def resolve_dtype(dtype: str, hf_config, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cpu":
        return torch.float32  # CPU matmuls are fastest and exact in float32
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(ckpt, str):
        ckpt = getattr(torch, ckpt, None)
    return ckpt if ckpt in (torch.float16, torch.bfloat16) else torch.bfloat16


class CheckpointSlice:
    """A checkpoint tensor not read yet. The TP weight loaders only `narrow` or slice what they
    load, so each rank reads just its shard from the (memory-mapped) file, never the full
    tensor. `.to(dtype)` is deferred to the read. Any other torch op reads the whole tensor."""

    def __init__(self, lazy, dtype: torch.dtype | None = None):
        self._lazy = lazy  # a safetensors PySafeSlice
        self._dtype = dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._lazy.get_shape())

    def to(self, dtype: torch.dtype) -> CheckpointSlice:
        return CheckpointSlice(self._lazy, dtype)

    def _read(self, index) -> torch.Tensor:
        t = self._lazy[index]
        return t if self._dtype is None else t.to(self._dtype)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self._read((slice(None),) * dim + (slice(start, start + length),))

    def __getitem__(self, index) -> torch.Tensor:
        return self._read(index)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def full(a):
            return a._read(slice(None)) if isinstance(a, CheckpointSlice) else a

        return func(*map(full, args), **{k: full(v) for k, v in (kwargs or {}).items()})


def safetensors_weights(path: str, sliced: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every checkpoint tensor; with `sliced`, matrices come as
    CheckpointSlice so that a tensor-parallel rank reads only its shard."""
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, f) for f in files]
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r}")
    for file in files:  # build_model's with_progress shows the bar
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                lazy = f.get_slice(name) if sliced else None
                yield (
                    name,
                    (
                        CheckpointSlice(lazy)
                        if lazy is not None and len(lazy.get_shape()) >= 2
                        else f.get_tensor(name)
                    ),
                )


def dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights of realistic scale, drawn on the model's device: speed does not depend on
    the values, but NaNs would hide bugs and zeros can run faster than real data."""
    for i, (name, p) in enumerate(model.named_parameters()):
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            gen = torch.Generator(device=p.device).manual_seed(seed * 100_003 + i)
            p.data.normal_(0, 0.02, generator=gen)


# Below this many bytes of weights loading takes a second or two: a bar would only flicker.
PROGRESS_MIN_BYTES = 256 * 2**20


def with_progress(weights: Iterator[tuple[str, torch.Tensor]], model: torch.nn.Module):
    """`weights` as they are, with a tqdm bar of the bytes loaded so far (GGUF dequantization and
    large safetensors reads take tens of seconds). Quiet when stderr is not a terminal (logs,
    tests) or the model is small. The total is the model's own parameters: a checkpoint that
    stores a tied matrix twice may end slightly past 100%."""
    import sys

    from tqdm import tqdm

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    element_size = next(model.parameters()).element_size()  # bytes once loaded, at the model's dtype
    quiet = total < PROGRESS_MIN_BYTES or not sys.stderr.isatty()
    with tqdm(
        total=total, desc="loading weights", unit="B", unit_scale=True, disable=quiet, leave=False
    ) as bar:
        for name, tensor in weights:
            yield name, tensor
            bar.update(math.prod(tensor.shape) * element_size)


def build_model(
    source: ModelSource,
    hf_config,
    dtype: torch.dtype,
    device: torch.device,
    tp: TPGroup = SINGLE,
    max_positions: int | None = None,
    seed: int = 0,
    quantization: str | None = None,
) -> torch.nn.Module:
    from minfer.models.quantize import check_quantization, quantize_model

    method = check_quantization(quantization, source.load_format, device.type, tp.size)
    cls = model_class_for(hf_config)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config, tp, max_positions)
    finally:
        torch.set_default_dtype(old)
    if source.load_format == "dummy":
        dummy_weights(model, seed)
    elif source.load_format == "gguf":
        from minfer.models.gguf import gguf_weights

        model.load_weights(with_progress(gguf_weights(source.path), model))
    else:
        model.load_weights(with_progress(safetensors_weights(source.path, sliced=tp.size > 1), model))
    quantize_model(model, method, source.path if source.load_format == "gguf" else None)
    model.eval()
    return model


def eos_token_ids(hf_config, tokenizer) -> frozenset[int]:
    ids = set()
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
