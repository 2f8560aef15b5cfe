"""Mixture-of-experts GGUF files (models/gguf_moe.py): a tiny Qwen3-MoE (`qwen3moe`) and a tiny
Mixtral (`llama` with experts, Q/K rows permuted as llama.cpp does) written the way llama.cpp
lays them out (experts stacked per projection, the router as `ffn_gate_inp`) load to
transformers' greedy tokens."""

from __future__ import annotations

import random

import numpy as np
import pytest
from tiny_models import hf_greedy, save_tiny_model

from minfer import LLM, SamplingParams

gguf = pytest.importorskip("gguf")

LAYER = {  # Hugging Face module (after model.layers.N.) -> GGUF name (after blk.N.)
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
    "mlp.gate": "ffn_gate_inp",
}
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves the two rotary halves of each llama Q/K head."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_tensors(hf, permute: bool) -> dict[str, np.ndarray]:
    cfg, out = hf.config, {}
    for name, tensor in hf.state_dict().items():
        array = tensor.float().numpy()
        if ".experts.gate_up_proj" in name:  # llama.cpp keeps gate and up apart, each stacked
            block = name.split(".")[2]
            gate, up = np.split(array, 2, axis=1)
            out[f"blk.{block}.ffn_gate_exps.weight"], out[f"blk.{block}.ffn_up_exps.weight"] = gate, up
            continue
        if ".experts.down_proj" in name:
            out[f"blk.{name.split('.')[2]}.ffn_down_exps.weight"] = array
            continue
        module, kind = name.rsplit(".", 1)
        if module in TOP:
            out[f"{TOP[module]}.{kind}"] = array
            continue
        block, rest = module.split(".")[2], ".".join(module.split(".")[3:])
        if permute and rest == "self_attn.q_proj":
            array = llama_cpp_permute(array, cfg.num_attention_heads)
        if permute and rest == "self_attn.k_proj":
            array = llama_cpp_permute(array, cfg.num_key_value_heads)
        out[f"blk.{block}.{LAYER[rest]}.{kind}"] = array
    return out


def write_moe_gguf(path, hf, arch: str) -> str:
    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    # A byte-level tokenizer of the 256 ids (the engine loads one; the prompts are token ids).
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([bytes([b]).hex() for b in range(cfg.vocab_size)])
    writer.add_token_types([1] * cfg.vocab_size)
    writer.add_token_scores([0.0] * cfg.vocab_size)  # no merges: derived from these
    writer.add_eos_token_id(0)
    for name, array in gguf_tensors(hf, permute=arch == "llama").items():
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("hf_arch,gguf_arch", [("qwen3_moe", "qwen3moe"), ("mixtral", "llama")])
def test_moe_gguf_matches_transformers(tmp_path, monkeypatch, hf_arch, gguf_arch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # every layer sparse: llama.cpp's files have no dense MLP layers among sparse ones
    overrides = {"mlp_only_layers": []} if hf_arch == "qwen3_moe" else {}
    hf = save_tiny_model(hf_arch, tmp_path / "hf", **overrides)
    path = write_moe_gguf(tmp_path / "tiny.gguf", hf, gguf_arch)
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (7, 30)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(path, kv_cache_tokens=512, dtype="float32", log_level="warning")  # as test_moe_parity
    assert type(llm.engine.model).__name__ == hf.config.architectures[0]
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [hf_greedy(hf, p, params.max_tokens) for p in prompts]
