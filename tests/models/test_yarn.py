"""YaRN RoPE scaling (Qwen2.5's and Qwen3's long-context setting, `rope_type: yarn`): the
frequencies and the cos/sin scale equal transformers' for every parameter form, the context
grows to the pretraining length times the factor, and a tiny model's greedy tokens and
log-probabilities equal transformers'."""

from __future__ import annotations

import random

import pytest
import torch
from greedy_parity import assert_greedy_parity, near_tie_gap
from tiny_models import hf_greedy, hf_token_logprobs, save_tiny_model, tiny_hf_config

from minfer import LLM, SamplingParams
from minfer.layers.rotary import (
    RotaryEmbedding,
    attention_factor,
    context_length,
    inverse_frequencies,
    rope_parameters,
)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
FORMS = [
    YARN,
    {**YARN, "beta_fast": 16, "beta_slow": 2},
    {**YARN, "attention_factor": 1.3},
    {**YARN, "mscale": 0.9, "mscale_all_dim": 0.7},
    {**YARN, "truncate": False},
    {**YARN, "factor": 1.0},
]


def _config(arch: str, rope: dict, **overrides):
    return tiny_hf_config(arch, rope_parameters={"rope_theta": 10_000.0, **rope}, **overrides)


@pytest.mark.parametrize("rope", FORMS)
def test_frequencies_and_scale_equal_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _config("qwen3", rope)
    expected_freq, expected_scale = ROPE_INIT_FUNCTIONS["yarn"](cfg, torch.device("cpu"))
    params = rope_parameters(cfg)
    assert torch.equal(inverse_frequencies(cfg.head_dim, params), expected_freq)
    assert attention_factor(params) == pytest.approx(expected_scale, rel=1e-12)
    table = RotaryEmbedding(cfg.head_dim, 8, params).cos_sin
    assert table[0, 0].item() == pytest.approx(expected_scale)  # cos(0) times the scale


def test_context_is_the_pretraining_length_times_the_factor():
    assert context_length(_config("qwen3", YARN, max_position_embeddings=32)) == 128
    assert context_length(_config("qwen3", YARN, max_position_embeddings=512)) == 512  # never shorter
    assert context_length(tiny_hf_config("qwen3", max_position_embeddings=100)) == 100


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_yarn_model_matches_transformers(arch, tmp_path):
    rope = {"rope_theta": 10_000.0, **YARN}
    hf = save_tiny_model(arch, tmp_path / "yarn", rope_parameters=rope, max_position_embeddings=32)
    plain = save_tiny_model(arch, tmp_path / "plain", max_position_embeddings=32)  # same weights
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (9, 70)]  # past the 32 pretrained
    llm = LLM(
        str(tmp_path / "yarn"),
        kv_cache_tokens=512,
        chunked_prefill_size=24,
        dtype="float32",
        log_level="warning",
    )
    assert llm.engine.max_model_len == 128
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert_greedy_parity(
            hf, prompt, out.token_ids, hf_greedy(hf, prompt, 16), near_tie_gap(llm.engine.dtype)
        )
    out = outs[1]
    got = torch.tensor(out.prompt_logprobs.logprobs[1:] + out.logprobs.logprobs)
    sequence = prompts[1] + out.token_ids
    torch.testing.assert_close(got, hf_token_logprobs(hf, sequence), atol=2e-5, rtol=0)
    assert (got - hf_token_logprobs(plain, sequence)).abs().max() > 1e-3
