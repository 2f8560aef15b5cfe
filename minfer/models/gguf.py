"""Read a llama.cpp GGUF file as a Hugging Face checkpoint: config, float32 weights, tokenizer.

Three things differ from a Hugging Face checkpoint, and each is undone here:
  - names: `blk.3.attn_q.weight` is `model.layers.3.self_attn.q_proj.weight`;
  - dims: GGUF lists a tensor's dims fastest-varying first, the reverse of torch's shape;
  - rotary layout: for `llama` files, llama.cpp's converter interleaves the two rotary halves
    of every Q and K head (its kernels rotate adjacent pairs; ours rotate halves).

Opening a GGUF costs seconds even for a 135M model: `GGUFReader` parses every vocabulary
string, dequantization runs in numpy, transformers builds the tokenizer from the vocab.
SmolLM2-135M-Instruct Q4_1 on a 2-core CPU: config 2.2 s, weights 2.9-3.6 s, tokenizer 2.7 s
(8 s) converted; 0.2-2.6 s from the cache (weights: 513 MiB of float32, page cache warm or not).
So the first load saves the converted config, tokenizer and (for files up to
`CACHE_MAX_WEIGHT_BYTES` of float32) weights under `$XDG_CACHE_HOME/minfer/gguf/<key>/`;
the key covers the file's path, size and mtime, `CACHE_VERSION` and the versions of
transformers and gguf. Later loads read the copy. Both paths return the same values (config
and tokenizer are served from the copy just written; weights survive float32 safetensors
exactly), and a cache that cannot be written only costs the time.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np
import torch

from minfer.models.gguf_cache import cache_dir, publish
from minfer.models.gguf_moe import MOE_ARCHITECTURES, MOE_LAYER_NAMES, MOE_MODEL_TYPES, moe_architecture

log = logging.getLogger(__name__)

CACHE_MAX_WEIGHT_BYTES = 4 << 30  # float32 copies of larger models would cost more disk than they save time

# GGUF `general.architecture` -> Hugging Face architecture. Mistral files say `llama` (llama.cpp
# runs them as Llama), and minfer's Mistral is the Llama decoder, so they load as Llama.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    **MOE_ARCHITECTURES,
}
MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
MODEL_TYPES.update(MOE_MODEL_TYPES)

# Architectures whose Q/K rows llama.cpp's converter permutes (see `unpermute_qk`).
PERMUTED_QK = {"llama"}

TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {  # blk.N.<key> -> model.layers.N.<value>
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    **MOE_LAYER_NAMES,
}
# Tensors that carry no weights of their own: llama.cpp stores Llama 3 RoPE scaling as
# per-frequency factors in `rope_freqs`; `gguf_config` turns them back into rope parameters.
NOT_WEIGHTS = {"rope_freqs.weight"}


# ---- public API ---------------------------------------------------------------------------


def gguf_config(path: str):
    """A transformers config (LlamaConfig, Qwen2Config, Qwen3Config) built from the GGUF metadata."""
    cache = cache_dir(path)
    if not (cache / "config").exists():
        from gguf import GGUFReader

        config = _config_from_reader(GGUFReader(path))
        config.name_or_path = path
        if not publish(cache, "config", config.save_pretrained):
            return config
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(cache / "config")
    config.name_or_path = path  # as a fresh conversion has it, not the cache's directory
    return config


def gguf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every weight in the file, dequantized, with
    llama.cpp's Q/K row permutation undone."""
    cached = cache_dir(path) / "weights" / "model.safetensors"
    if cached.exists():
        log.info("loading GGUF weights of %s from the converted copy %s", path, cached)
        yield from _read_safetensors(cached)
        return
    from gguf import GGUFReader

    reader = GGUFReader(path)
    float32_bytes = 4 * sum(int(t.n_elements) for t in reader.tensors)
    if float32_bytes > CACHE_MAX_WEIGHT_BYTES:
        log.info(
            "not caching converted weights of %s: %.1f GiB as float32 exceeds CACHE_MAX_WEIGHT_BYTES",
            path,
            float32_bytes / 2**30,
        )
        yield from _convert_weights(reader)
        return
    start = time.perf_counter()
    weights = dict(_convert_weights(reader))
    seconds = time.perf_counter() - start
    if publish(cache_dir(path), "weights", partial(_write_safetensors, weights)):
        log.info(
            "converted GGUF weights of %s in %.1f s and cached them as float32 (%.0f MiB) at %s",
            path,
            seconds,
            float32_bytes / 2**20,
            cached,
        )
    for name in list(weights):  # hand over and forget each tensor, so the model holds the only copy
        yield name, weights.pop(name)


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation. Its converter reorders each head's rows from
    [first half | second half] to [h0, h0', h1, h1', ...] (pairs interleaved); this puts the
    halves back. Works on weights [rows, in] and on biases [rows]."""
    rest = weight.shape[1:]
    head_dim = weight.shape[0] // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


# ---- conversion ---------------------------------------------------------------------------


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _architecture(reader) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; minfer reads {sorted(ARCHITECTURES)}")
    return arch


def _config_from_reader(reader):
    from transformers import AutoConfig

    arch = _architecture(reader)
    tensors = {t.name: t for t in reader.tensors}

    def meta(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    hidden_size, num_heads = meta("embedding_length"), meta("attention.head_count")
    head_dim = meta("attention.key_length") or (meta("rope.dimension_count") if arch == "llama" else None)
    head_dim = head_dim or hidden_size // num_heads
    rope = {"rope_type": "default", "rope_theta": float(meta("rope.freq_base", 10000.0))}
    scaling = meta("rope.scaling.type", "none")
    if scaling != "none":
        rope.update(rope_type=scaling, factor=float(meta("rope.scaling.factor")))
        if meta("rope.scaling.original_context_length"):
            rope["original_max_position_embeddings"] = int(meta("rope.scaling.original_context_length"))
    if "rope_freqs.weight" in tensors:
        factors = _dequantize(tensors["rope_freqs.weight"]).double()
        rope = _llama3_rope_from_factors(factors, rope["rope_theta"], meta("rope.dimension_count", head_dim))

    eos = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(i for i in eos if i is not None))  # llama 3 ends turns with eot, not eos
    architecture, moe_fields = moe_architecture(ARCHITECTURES[arch], meta)
    return AutoConfig.for_model(
        MODEL_TYPES[architecture],
        architectures=[architecture],
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # the embedding's rows (GGUF dims reversed)
        hidden_size=hidden_size,
        intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=meta("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=meta("attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon"),
        rope_parameters=rope,
        max_position_embeddings=meta("context_length"),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=eos[0] if len(eos) == 1 else (eos or None),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        **moe_fields,
    )


def _llama3_rope_from_factors(factors: torch.Tensor, theta: float, rope_dim: int) -> dict:
    """Recover Llama 3 RoPE parameters from llama.cpp's per-frequency divisors.

    The divisor is 1 for high frequencies, `factor` for low ones, and in between
    1 / ((1 - s) / factor + s) with s = old_len / (wavelen * (high - low)) - low / (high - low),
    which is linear in 1 / wavelen. Scaling old_len, low and high together changes nothing,
    so low = 1 (Llama 3.1's value) and the slope and intercept of s give high and old_len.
    """
    from minfer.layers.rotary import inverse_frequencies

    params = {"rope_type": "default", "rope_theta": theta}
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return params
    inv_freq = inverse_frequencies(rope_dim, params).double()
    medium = (factors > 1 + 1e-5) & (factors < factor * (1 - 1e-5))
    if int(medium.sum()) >= 2:
        smooth = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit((inv_freq[medium] / (2 * math.pi)).numpy(), smooth.numpy(), 1)
        params.update(
            rope_type="llama3",
            factor=factor,
            low_freq_factor=1.0,
            high_freq_factor=float(f"{1 - 1 / intercept:.6g}"),
            original_max_position_embeddings=round(-slope / intercept),
        )
        expected = inv_freq / factors
        if torch.allclose(inverse_frequencies(rope_dim, params).double(), expected, rtol=1e-4, atol=0):
            return params
    raise ValueError(
        f"cannot express the GGUF's rope_freqs factors {factors.tolist()} as Llama 3 RoPE scaling"
    )


def _dequantize(tensor) -> torch.Tensor:
    from gguf.quants import dequantize

    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which the gguf "
            "package cannot dequantize"
        ) from None
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-varying first
    # F32/F16 come back as read-only views of the memory-mapped file: copy them out.
    return torch.from_numpy(np.require(array, np.float32, ["C", "W", "O"]).reshape(shape))


def _hf_name(gguf_name: str) -> str:
    module, _, kind = gguf_name.rpartition(".")  # kind: weight | bias
    if module in TOP_LEVEL_NAMES:
        return f"{TOP_LEVEL_NAMES[module]}.{kind}"
    parts = module.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{kind}"
    raise KeyError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart that minfer knows")


def _convert_weights(reader) -> Iterator[tuple[str, torch.Tensor]]:
    arch = _architecture(reader)
    num_heads = _field(reader, f"{arch}.attention.head_count")
    heads = {"q_proj": num_heads, "k_proj": _field(reader, f"{arch}.attention.head_count_kv", num_heads)}
    for tensor in reader.tensors:
        if tensor.name in NOT_WEIGHTS:
            continue
        name = _hf_name(tensor.name)
        weight = _dequantize(tensor)
        proj = name.split(".")[-2]
        if arch in PERMUTED_QK and proj in heads:
            weight = unpermute_qk(weight, heads[proj])
        yield name, weight


# ---- cache --------------------------------------------------------------------------------


def _write_safetensors(weights: dict[str, torch.Tensor], directory: Path) -> None:
    from safetensors.torch import save_file

    save_file(weights, str(directory / "model.safetensors"), metadata={"order": json.dumps(list(weights))})


def _read_safetensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        for name in json.loads(f.metadata()["order"]):  # the file's own order, as a fresh conversion yields
            yield name, f.get_tensor(name)
