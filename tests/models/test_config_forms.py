"""Both config forms give the same RoPE: the older `rope_theta` + `rope_scaling` that most
checkpoints carry, and transformers 5's `rope_parameters`."""

from __future__ import annotations

import json

import pytest
import torch

from minfer.layers.rotary import inverse_frequencies, rope_parameters

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


def _load(tmp_path, extra: dict):
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps({**BASE, **extra}))
    return AutoConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("form", ["old", "new"])
def test_llama3_rope_from_either_form(tmp_path, form):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if form == "old":
        cfg = _load(tmp_path, {"rope_theta": 500000.0, "rope_scaling": LLAMA3})
    else:
        cfg = _load(tmp_path, {"rope_parameters": {**LLAMA3, "rope_theta": 500000.0}})
    params = rope_parameters(cfg)
    assert params["rope_type"] == "llama3" and params["rope_theta"] == 500000.0
    ours = inverse_frequencies(16, params)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    assert torch.allclose(ours, theirs.float(), rtol=1e-6)


def test_plain_rope_theta(tmp_path):
    cfg = _load(tmp_path, {"rope_theta": 12345.0})
    params = rope_parameters(cfg)
    assert params["rope_type"] == "default" and params["rope_theta"] == 12345.0
    expected = 1.0 / (12345.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert torch.allclose(inverse_frequencies(16, params), expected)
