"""Sliding-window models against transformers, token for token (greedy): Mistral's (and
Mixtral's) window on every layer, and Qwen2's use_sliding_window on the layers from max_window_layers up (layer 0
full, layer 1 windowed). Prompts and answers run past the window, through chunked prefill, a
prefix-cache hit longer than the window, and decode; and the log-probability of every prompt and
answer token equals transformers' to float32 rounding, where the same weights without the window
give other values, so the window is what is checked."""

from __future__ import annotations

import random

import pytest
import torch
from greedy_parity import assert_greedy_parity, near_tie_gap
from tiny_models import hf_greedy, hf_token_logprobs, save_tiny_model

from minfer import LLM, SamplingParams

WINDOW = 16
CASES = {
    "mistral": dict(sliding_window=WINDOW),
    "mixtral": dict(sliding_window=WINDOW),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
}
WINDOWS = {"mistral": [WINDOW, WINDOW], "mixtral": [WINDOW, WINDOW], "qwen2": [None, WINDOW]}  # per layer


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("arch", sorted(CASES))
def test_sliding_window_matches_transformers(arch, tmp_path):
    hf = save_tiny_model(arch, tmp_path / "windowed", **CASES[arch])
    full = save_tiny_model(arch, tmp_path / "full")  # the same weights, no window
    prompts = _prompts(3, [5, 70, 17, 33])
    max_tokens = 24  # the shortest prompt's answer, too, runs past the window
    expected = [hf_greedy(hf, p, max_tokens) for p in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for page_size, overlap in [(1, True), (16, False)]:
        llm = LLM(
            str(tmp_path / "windowed"),
            page_size=page_size,
            chunked_prefill_size=24,  # the 70-token prompt spans three prefill steps
            kv_cache_tokens=1024,
            disable_overlap_schedule=not overlap,
            dtype="float32",  # the log-probabilities below are compared to float32 rounding (a GPU's default is bf16)
            log_level="warning",
        )
        layers = llm.engine.model.model.layers
        assert [layer.self_attn.attn.sliding_window for layer in layers] == WINDOWS[arch]
        # twice: the second round's prompts hit the prefix cache, past the window
        for _ in range(2):
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            for prompt, out, exp in zip(prompts, outs, expected):
                assert_greedy_parity(hf, prompt, out.token_ids, exp, near_tie_gap(llm.engine.dtype))
        assert llm.scheduler.kv.prefix_cache.cached_pages > 0
    # Log-probabilities of the 70-token prompt (three chunks) and of its answer (decode steps).
    scored = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, prompt_logprobs=0
    )
    out = llm.generate([prompts[1]], scored, use_tqdm=False)[0]
    got = torch.tensor(out.prompt_logprobs.logprobs[1:] + out.logprobs.logprobs)
    sequence = prompts[1] + out.token_ids
    torch.testing.assert_close(got, hf_token_logprobs(hf, sequence), atol=2e-5, rtol=0)
    assert (got - hf_token_logprobs(full, sequence)).abs().max() > 1e-3


def test_window_as_long_as_the_context_is_no_window(tmp_path):
    """A window that cannot bind (>= max_position_embeddings) is dropped, so the layers keep the
    full-attention kernels."""
    save_tiny_model("mistral", tmp_path, sliding_window=512)  # TINY's max_position_embeddings
    llm = LLM(str(tmp_path), kv_cache_tokens=256, log_level="warning")
    assert [layer.self_attn.attn.sliding_window for layer in llm.engine.model.model.layers] == [None, None]


def test_quantized_forward_keeps_the_window(tmp_path):
    """The --quantization CPU path has its own decoder loop (models/quantized_forward.py): it
    hands each layer's window to the attention backend too."""
    save_tiny_model("mistral", tmp_path, sliding_window=WINDOW)
    llm = LLM(str(tmp_path), device="cpu", kv_cache_tokens=256, quantization="int8", log_level="warning")
    lean = llm.engine.model.model.lean_forward
    assert [layer.window for layer in lean.layers] == [WINDOW, WINDOW]
    out = llm.generate(
        _prompts(4, [40]), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].token_ids) == 4
