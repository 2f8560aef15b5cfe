"""`--attention-backend sdpa`: the torch backend with its prefill through torch's SDPA, on a
float32 model, against transformers' sdpa attention: greedy tokens (near-tie criterion) through
chunked prefill, a prefix-cache hit and decode, and every prompt and answer log-probability to
float32 rounding. `auto` keeps the eager-identical backend for a float32 model on the CPU."""

from __future__ import annotations

import random

import torch
import transformers
from greedy_parity import assert_greedy_parity, near_tie_gap
from tiny_models import hf_greedy, hf_token_logprobs, save_tiny_model

from minfer import LLM, SamplingParams
from minfer.attention.torch_backend import TorchAttentionBackend
from minfer.attention.torch_fast import FastTorchAttentionBackend


def test_sdpa_backend_matches_transformers_sdpa(tmp_path):
    save_tiny_model("qwen3", tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="sdpa", dtype=torch.float32
    ).eval()
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (6, 70, 33)]
    max_tokens = 12
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(
        str(tmp_path),
        attention_backend="sdpa",
        chunked_prefill_size=24,  # the 70-token prompt's later chunks attend to cached ones
        kv_cache_tokens=1024,
        dtype="float32",
        log_level="warning",
    )
    try:
        assert isinstance(llm.engine.backend, FastTorchAttentionBackend)
        for _ in range(2):  # the second round's prompts hit the prefix cache
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            for prompt, out in zip(prompts, outs):
                expected = hf_greedy(hf, prompt, max_tokens)
                assert_greedy_parity(hf, prompt, out.token_ids, expected, near_tie_gap(torch.float32))
        assert llm.scheduler.kv.prefix_cache.cached_pages > 0
        scored = SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, prompt_logprobs=0
        )
        out = llm.generate([prompts[1]], scored, use_tqdm=False)[0]
        got = torch.tensor(out.prompt_logprobs.logprobs[1:] + out.logprobs.logprobs)
        torch.testing.assert_close(got, hf_token_logprobs(hf, prompts[1] + out.token_ids), atol=2e-5, rtol=0)
    finally:
        llm.shutdown()


def test_auto_keeps_the_eager_backend_for_float32(tmp_path):
    save_tiny_model("llama", tmp_path)
    # on the CPU on any machine: on a GPU `auto` takes the Triton kernels, whatever the dtype
    llm = LLM(str(tmp_path), device="cpu", kv_cache_tokens=256, log_level="warning")
    try:
        assert type(llm.engine.backend) is TorchAttentionBackend
    finally:
        llm.shutdown()
