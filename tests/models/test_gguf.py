"""GGUF loading: weights, config and tokenizer against transformers' own GGUF reader, and round
trips through tiny GGUF files written here the way llama.cpp's converter writes them."""

from __future__ import annotations

import logging
import math
import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from default_model import default_model_file, needs_default_model
from gguf import GGMLQuantizationType as Q

from minfer.layers.rotary import inverse_frequencies, rope_parameters
from minfer.models import gguf as mg
from minfer.models.tokenizer_files import gguf_tokenizer

DEFAULT = default_model_file() or ""


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Every test converts into its own cache, never the user's, and removes it after
    (the default model's float32 copy is 0.5 GB)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    yield
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)


# ---- the default model against transformers -------------------------------------------------


@pytest.fixture(scope="module")
def default_split():
    return os.path.split(DEFAULT)


@needs_default_model
def test_default_model_weights_match_transformers(default_reference, caplog):
    reference = default_reference.state_dict()
    with caplog.at_level(logging.INFO, logger="minfer.models.gguf"):
        fresh = list(mg.gguf_weights(DEFAULT))  # converts and caches
        cached = list(mg.gguf_weights(DEFAULT))  # reads the cached copy
    assert "cached them as float32" in caplog.text and "from the converted copy" in caplog.text

    assert "lm_head.weight" not in dict(fresh)  # SmolLM2 ties the head to the embedding
    assert set(dict(fresh)) == set(reference) - {"lm_head.weight"}
    for name, tensor in fresh:
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, reference[name], msg=name)
    assert [n for n, _ in cached] == [n for n, _ in fresh]
    for (name, a), (_, b) in zip(fresh, cached):
        assert torch.equal(a, b), name


@needs_default_model
def test_default_model_config_matches_transformers(default_reference):
    reference = default_reference.config  # transformers' own reading of the GGUF's metadata
    ours = mg.gguf_config(DEFAULT)
    assert ours.architectures == ["LlamaForCausalLM"]
    for field in (
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert getattr(ours, field) == getattr(reference, field), field
    assert rope_parameters(ours) == rope_parameters(reference)
    assert mg.gguf_config(DEFAULT).to_dict() == ours.to_dict()  # cache hit


@needs_default_model
def test_default_tokenizer_same_with_and_without_cache(tmp_path, monkeypatch, default_split):
    cached = gguf_tokenizer(DEFAULT)
    assert (mg.cache_dir(DEFAULT) / "tokenizer").is_dir()
    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/minfer-cannot-write-here")
    fresh = gguf_tokenizer(DEFAULT)  # the cache cannot be written: straight from the GGUF

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Héllo 🙂\n\n  wörld"},
    ]
    for tok in (cached, fresh):
        assert tok.chat_template and "<|im_start|>" in tok.chat_template
        assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert cached.apply_chat_template(messages, add_generation_prompt=True) == fresh.apply_chat_template(
        messages, add_generation_prompt=True
    )
    text = "Héllo 🙂\n\n  wörld <|im_end|> 12345"
    assert cached(text).input_ids == fresh(text).input_ids
    assert cached.decode(cached(text).input_ids) == fresh.decode(fresh(text).input_ids)
    assert len(cached) == len(fresh)


# ---- tiny files written the way llama.cpp writes them ---------------------------------------

HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_HF_TO_GGUF[module]}.{kind}"


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama Q/K rows: interleave each head's halves."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def tiny_model(arch: str, tied: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        arch,
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    for name, tensor in state.items():  # make norms and biases non-trivial so a misplaced one shows
        if "norm" in name or name.endswith(".bias"):
            state[name] = torch.randn_like(tensor)
    if tied:
        del state["lm_head.weight"]
    return config, state


def write_gguf(
    path,
    arch: str,
    config,
    state: dict[str, torch.Tensor],
    qtype: Q = Q.F32,
    extra: dict[str, np.ndarray] | None = None,
) -> str:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_key_length(config.head_dim)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in state.items():
        array = tensor.numpy()
        if arch == "llama" and ".q_proj." in name:
            array = llama_cpp_permute(array, config.num_attention_heads)
        if arch == "llama" and ".k_proj." in name:
            array = llama_cpp_permute(array, config.num_key_value_heads)
        if array.ndim == 1 or qtype == Q.F32:  # llama.cpp keeps norms and biases in F32
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(array, dtype=np.float32))
        elif qtype == Q.F16:
            writer.add_tensor(gguf_name(name), array.astype(np.float16))
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


# Largest error of one weight, as a fraction of its tensor's largest magnitude: half a
# quantization step (Q8_0: step amax/127; Q4_1: (max - min)/15), except Q4_0, which maps the
# block's largest magnitude to -8 and clips its opposite to +7, one whole step (amax/8).
TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 5e-3, Q.Q4_0: 0.13, Q.Q4_1: 0.07}


@pytest.mark.parametrize("qtype", list(TOLERANCE), ids=lambda q: q.name)
def test_llama_round_trip(tmp_path, qtype):
    config, state = tiny_model("llama", tied=qtype != Q.F32)
    path = write_gguf(tmp_path / "tiny.gguf", "llama", config, state, qtype)

    weights = dict(mg.gguf_weights(path))
    assert set(weights) == set(state)
    for name, original in state.items():
        got = weights[name]
        assert got.dtype == torch.float32 and got.shape == original.shape, name
        tolerance = TOLERANCE[qtype if original.dim() == 2 else Q.F32] * float(original.abs().max())
        torch.testing.assert_close(got, original, rtol=0, atol=tolerance, msg=name)

    ours = mg.gguf_config(path)
    assert ours.architectures == ["LlamaForCausalLM"]
    assert ours.tie_word_embeddings == (qtype != Q.F32)
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert getattr(ours, field) == getattr(config, field), field
    assert ours.rms_norm_eps == pytest.approx(config.rms_norm_eps)
    assert rope_parameters(ours) == rope_parameters(config)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_round_trip_is_not_unpermuted(tmp_path, arch):
    """llama.cpp leaves Qwen's Q/K rows alone (it rotates them NeoX-style), so must we."""
    config, state = tiny_model(arch, tied=True)
    assert any(".bias" in n for n in state) == (arch == "qwen2")
    assert any("q_norm" in n for n in state) == (arch == "qwen3")
    path = write_gguf(tmp_path / "tiny.gguf", arch, config, state)
    weights = dict(mg.gguf_weights(path))
    assert set(weights) == set(state)
    for name, original in state.items():
        assert torch.equal(weights[name], original), name
    assert mg.gguf_config(path).architectures == [f"Qwen{arch[-1]}ForCausalLM"]


def test_unpermute_inverts_llama_cpp_permute():
    weight = torch.randn(6 * 8, 5)
    for heads in (1, 2, 6):
        permuted = torch.from_numpy(llama_cpp_permute(weight.numpy(), heads))
        assert not torch.equal(permuted, weight)
        assert torch.equal(mg.unpermute_qk(permuted, heads), weight)
    bias = torch.randn(16)
    assert torch.equal(mg.unpermute_qk(torch.from_numpy(llama_cpp_permute(bias.numpy(), 2)), 2), bias)


def test_cache_hit_and_fallback_give_the_same_results(tmp_path, monkeypatch, caplog):
    config, state = tiny_model("llama", tied=False)
    path = write_gguf(tmp_path / "tiny.gguf", "llama", config, state, Q.Q8_0)

    first = list(mg.gguf_weights(path))
    first_config = mg.gguf_config(path).to_dict()
    assert sorted(p.name for p in mg.cache_dir(path).iterdir()) == ["config", "weights"]
    with caplog.at_level(logging.INFO, logger="minfer.models.gguf"):
        second = list(mg.gguf_weights(path))
    assert "from the converted copy" in caplog.text
    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/minfer-cannot-write-here")
    with caplog.at_level(logging.WARNING, logger="minfer.models.gguf"):
        uncached = list(mg.gguf_weights(path))
        assert mg.gguf_config(path).to_dict() == first_config
    assert "cannot cache converted GGUF weights" in caplog.text

    for other in (second, uncached):
        assert [n for n, _ in other] == [n for n, _ in first]
        for (name, a), (_, b) in zip(first, other):
            assert torch.equal(a, b), name


def test_cache_key_follows_the_file(tmp_path):
    config, state = tiny_model("llama", tied=True)
    path = write_gguf(tmp_path / "tiny.gguf", "llama", config, state)
    before = mg.cache_dir(path)
    assert mg.cache_dir(path) == before
    os.utime(path, ns=(0, 12345))
    assert mg.cache_dir(path) != before


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path):
    """llama.cpp stores Llama 3.1 RoPE scaling only as per-frequency divisors (`rope_freqs`)."""
    llama31 = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config, state = tiny_model("llama", tied=True)
    config.head_dim = 128  # enough frequencies to fall inside the blended band
    config.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    plain = inverse_frequencies(128, {"rope_type": "default", "rope_theta": 500000.0})
    # llama.cpp's formula: 1 above the band, `factor` below it, blended inside.
    wavelen = 2 * math.pi / plain.double()
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    blended = 1 / ((1 - smooth) / 8.0 + smooth)
    divisors = torch.where(wavelen < 8192 / 4.0, 1.0, torch.where(wavelen > 8192, 8.0, blended))
    embedding_only = {"model.embed_tokens.weight": state["model.embed_tokens.weight"]}
    path = write_gguf(
        tmp_path / "tiny.gguf",
        "llama",
        config,
        embedding_only,
        extra={"rope_freqs.weight": divisors.float().numpy()},
    )

    params = rope_parameters(mg.gguf_config(path))
    assert params["rope_type"] == "llama3"
    assert params == pytest.approx(llama31)
    torch.testing.assert_close(inverse_frequencies(128, params), inverse_frequencies(128, llama31))
    assert "model.embed_tokens.weight" in dict(mg.gguf_weights(path))  # rope_freqs is not a weight


def test_unsupported_type_and_architecture_are_named(tmp_path):
    config, state = tiny_model("llama", tied=True)
    # one tensor of an integer type, which no dequantizer handles
    state = {k: v for k, v in state.items() if k != "model.layers.0.mlp.down_proj.weight"}
    path = write_gguf(
        tmp_path / "int.gguf",
        "llama",
        config,
        state,
        Q.Q8_0,
        extra={"blk.0.ffn_down.weight": np.zeros((64, 128), dtype=np.int8)},
    )
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_down\.weight.*I8"):
        list(mg.gguf_weights(path))

    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2", config, {})
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        mg.gguf_config(path)
