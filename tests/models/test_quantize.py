"""--quantization: GGUF blocks and weights quantized at load, through torch's low-bit kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from test_gguf import private_cache, tiny_model, write_gguf  # noqa: F401 - private_cache is autouse

from minfer.attention.choice import make_attention_backend
from minfer.attention.torch_backend import TorchAttentionBackend
from minfer.attention.torch_fast import FastTorchAttentionBackend
from minfer.config import ConfigError
from minfer.layers.quantized_linear import (
    dense_dtype,
    dequantize_int4,
    int4_from_blocks,
    quantize_int4,
    quantize_int8,
)
from minfer.models import gguf as mg
from minfer.models.gguf_blocks import gguf_blocks
from minfer.models.loader import build_model, load_hf_config, resolve_model
from minfer.models.quantize import check_quantization, decode_weight_bytes, linear_layers


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_gguf_blocks_are_the_dequantized_weights(tmp_path, qtype):
    """The blocks read raw (with the Q/K rows un-permuted) stand for exactly the float32
    matrices of the default load path; the int4 kernel with float32 scales multiplies them
    to float32 rounding."""
    config, state = tiny_model("llama", tied=True)
    path = write_gguf(tmp_path / "tiny.gguf", "llama", config, state, qtype)
    floats = dict(mg.gguf_weights(path))
    blocks = gguf_blocks(path)  # parsed from the file, then cached
    assert set(blocks) == {n for n, t in floats.items() if t.dim() == 2 and n.startswith("model.layers.")}
    cached = gguf_blocks(path)
    for name, b in blocks.items():
        assert cached[name].kind == b.kind == qtype.name
        assert all(torch.equal(getattr(cached[name], p), getattr(b, p)) for p in ("codes", "scales", "mins"))
    x = torch.randn(3, config.hidden_size)
    for name, b in blocks.items():
        want = floats[name]
        torch.testing.assert_close(dequantize_int4(b.codes, b.scales, b.mins), want, rtol=1e-6, atol=1e-7)
        if qtype != Q.Q8_0 and want.shape[1] == config.hidden_size:
            kernel = int4_from_blocks(b.codes, b.scales, b.mins, dtype=torch.float32)
            kernel.max_rows = 1 << 30
            assert _relative_error(kernel.matmul(x, want), F.linear(x, want)) < 1e-5


@pytest.mark.parametrize(
    "method,qtype", [("gguf", Q.Q4_1), ("gguf", Q.Q4_0), ("gguf", Q.Q8_0), ("int4", Q.F32), ("int8", Q.F32)]
)
def test_quantized_layers_match_their_float_matrix(tmp_path, method, qtype):
    """Every linear layer's low-bit kernel (bfloat16 activations) against a float32 matmul of
    the weights it stands for: within 1% of the output's largest magnitude (bfloat16 keeps 8
    bits); prefill-sized inputs take the dense matrix: float32, or bfloat16 where the CPU
    multiplies it natively (then its activations are bfloat16 too)."""
    config, state = tiny_model("llama", tied=True)
    path = write_gguf(tmp_path / "tiny.gguf", "llama", config, state, qtype)
    source = resolve_model(path)
    model = build_model(
        source, load_hf_config(source), torch.float32, torch.device("cpu"), quantization=method
    )
    layers = linear_layers(model)
    assert layers and all(layer.low_bit is not None for _, layer in layers)
    for _, layer in layers:
        assert layer.weight.dtype == dense_dtype()
        x = torch.randn(2, layer.weight.shape[1])
        assert _relative_error(layer(x), F.linear(x, layer.weight.float())) < 1e-2
        long = torch.randn(40, layer.weight.shape[1])
        want = F.linear(long.to(dense_dtype()), layer.weight).float()
        torch.testing.assert_close(layer(long), want, rtol=0, atol=0)
        assert _relative_error(layer(long), F.linear(long, layer.weight.float())) < 1e-2


def test_quantize_at_load_stays_near_the_float_weights():
    weight = torch.randn(48, 64)
    codes, scales, mins = quantize_int4(weight)
    assert codes.max() <= 15
    assert (dequantize_int4(codes, scales, mins) - weight).abs().max() <= (scales.max() / 2) * 1.001
    _, dequantized = quantize_int8(weight)
    assert _relative_error(dequantized, weight) < 1 / 127


def test_unfit_quantization_is_refused():
    with pytest.raises(ConfigError, match="needs a .gguf model"):
        check_quantization("gguf", "safetensors", "cpu", 1)
    with pytest.raises(ConfigError, match="CPU only"):
        check_quantization("int4", "gguf", "cuda", 1)
    with pytest.raises(ConfigError, match="--tp 1"):
        check_quantization("int8", "gguf", "cpu", 2)
    assert check_quantization(None, "safetensors", "cuda", 4) == "none"


def test_none_keeps_the_float32_model_and_quantized_decode_reads_less(tmp_path):
    """--quantization none leaves every matrix float32 and every layer and the head on their
    float path; gguf gives the head its low-bit form too, and a decode step reads less."""
    config, state = tiny_model("llama", tied=True)
    path = write_gguf(tmp_path / "tiny.gguf", "llama", config, state, Q.Q4_1)
    source = resolve_model(path)
    models = {
        method: build_model(
            source, load_hf_config(source), torch.float32, torch.device("cpu"), quantization=method
        )
        for method in ("none", "gguf")
    }
    plain = models["none"]
    assert all(p.dtype == torch.float32 for p in plain.parameters())
    assert all(m.low_bit is None for _, m in linear_layers(plain)) and plain.lm_head.low_bit is None
    quantized = models["gguf"]
    assert quantized.lm_head.low_bit is not None
    float_bytes = sum(p.numel() * p.element_size() for p in quantized.parameters())
    head_bytes = quantized.lm_head.weight.numel() * 4
    assert decode_weight_bytes(quantized, float_bytes) < float_bytes - head_bytes / 2
    hidden = torch.randn(3, config.hidden_size)
    torch.testing.assert_close(
        plain.compute_logits(hidden), F.linear(hidden, plain.lm_head.weight), rtol=0, atol=0
    )
    # Attention: the float32 model keeps the reference torch backend (bit-identical numerics),
    # the quantized one gets the faster path.
    backends = {
        m: make_attention_backend("auto", torch.device("cpu"), getattr(model, "quantized", False))
        for m, model in models.items()
    }
    assert type(backends["none"]) is TorchAttentionBackend
    assert type(backends["gguf"]) is FastTorchAttentionBackend


def test_cpu_default_running_cap_follows_quantization():
    """A quantized CPU model runs up to 32 requests (its throughput grows past 16: BENCHMARKS.md),
    the float32 default keeps 16; an explicit --max-running-requests always wins."""
    from minfer.config import default_chunked_prefill_size, default_max_running_requests

    assert default_max_running_requests("cpu") == default_max_running_requests("cpu", "none") == 16
    assert default_max_running_requests("cpu", "gguf") == default_max_running_requests("cpu", "int4") == 32
    assert default_max_running_requests("cuda", "none") > 32
    # and a quantized CPU model prefills in steps of 2048 tokens (concurrency 64 serves faster)
    assert default_chunked_prefill_size("cpu", "gguf") == 2048
    assert default_chunked_prefill_size("cpu") == default_chunked_prefill_size("cuda", "gguf") == 8192


def test_prepacked_dense_matrix_gives_f_linear_bits():
    """The oneDNN-laid-out copy of a bfloat16 dense matrix multiplies bit-identically to
    F.linear on the plain one, below and above the rows it is laid out for."""
    from minfer.layers.quantized_linear import PREPACKED_MAX_ROWS, prepack

    dense = torch.randn(96, 64).bfloat16()
    packed = prepack(dense)
    if packed is None:
        pytest.skip("no oneDNN bf16 layout here (no oneDNN, or no native bf16 products on this CPU)")
    codes, scales, mins = quantize_int4(dense.float())
    low_bit = int4_from_blocks(codes, scales, mins)
    low_bit.max_rows, low_bit.dense_packed = 2, packed
    for rows in (3, 16, 100, PREPACKED_MAX_ROWS + 1):
        x = torch.randn(rows, 64)
        assert torch.equal(low_bit.product(x, dense), F.linear(x.bfloat16(), dense))
